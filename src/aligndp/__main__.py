import sys

from aligndp.app.cli import main

sys.exit(main())
