"""`python -m engine.server --model smollm2-135m --port 8000`."""

from __future__ import annotations

import sys

from engine.server.launcher import main

if __name__ == "__main__":
    sys.exit(main())
