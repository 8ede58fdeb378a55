"""`python -m rp_service.worker JOB_DIR`: see rp_service.worker.main."""

import sys

from rp_service.worker.main import main

sys.exit(main())
