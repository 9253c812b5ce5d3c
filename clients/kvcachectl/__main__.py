"""``python -m kvcachectl``: the same as the console script."""

import sys

from kvcachectl import main

sys.exit(main())
