"""``python -m ringd.ctl``: ringctl without its console script."""

import sys

from ringd.ctl import main

sys.exit(main())
