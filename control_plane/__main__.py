"""`python -m control_plane [--host --port --nats-url --database-url]`: run the control plane."""

import sys

from control_plane.server import main

sys.exit(main())
