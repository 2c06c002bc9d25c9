import sys

from aligndp.cli import main

sys.exit(main())
