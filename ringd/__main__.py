import sys

from ringd.cli import main

sys.exit(main())
