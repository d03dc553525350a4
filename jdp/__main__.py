import sys

from jdp.cli import main

sys.exit(main())
