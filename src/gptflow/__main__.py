import sys

from gptflow.cli import main

sys.exit(main())
