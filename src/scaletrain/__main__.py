import sys

from scaletrain.cli import main

sys.exit(main())
