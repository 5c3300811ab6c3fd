"""`python -m engines --config-json '<EngineConfig JSON>'`: run one engine (engines/process/entry.py)."""
import sys

from engines.process.entry import main

sys.exit(main())
