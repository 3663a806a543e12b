"""``python -m app``: the same as ``mlxspec chat``."""

import sys

from mlxspec.commands.chat import main

sys.exit(main())
