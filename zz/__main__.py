# zz/__main__.py - lets `python -m zz` run the same command line as the `zz` script.
# Kept separate from cli.py so importing zz.cli never has side effects.
import sys

from zz.cli import main

sys.exit(main())
