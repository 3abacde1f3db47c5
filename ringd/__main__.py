import sys

from ringd.app.cli import main

sys.exit(main())
