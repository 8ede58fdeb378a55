"""`python -m rp_service.export REQUEST_JSON`: export one job's model (the daemon runs it).

The request is a JSON object: output (the job's output folder), spec (its JobSpec), type,
dest, name. Prints the result as one JSON line; an ExportError exits 2 with its message on
the last line of stderr.
"""

from __future__ import annotations

import json
import logging
import sys

from .gguf_file import ExportError
from .job import export_job


def main() -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    request = json.loads(sys.argv[1])
    try:
        result = export_job(
            request["output"],
            request["spec"],
            kind=request["type"],
            dest=request["dest"],
            name=request["name"],
        )
    except ExportError as exc:
        print(str(exc), file=sys.stderr)
        return 2
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
