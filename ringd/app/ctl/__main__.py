"""``python -m ringd.app.ctl``: ringctl without its console script."""

import sys

from ringd.app.ctl import main

sys.exit(main())
