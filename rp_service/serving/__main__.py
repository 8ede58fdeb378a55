"""`python -m rp_service.serving BASE_JSON --device DEV`: see rp_service.serving.process."""

import sys

from rp_service.serving.process import main

sys.exit(main())
