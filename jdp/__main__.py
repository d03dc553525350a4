import sys

from jdp.cli.main import main

sys.exit(main())
