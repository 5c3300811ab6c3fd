"""`python -m harness.chaos ...` = `understudy chaos ...`."""
import sys

from .cli import main

sys.exit(main())
