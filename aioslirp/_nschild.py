"""Old import path of :mod:`aioslirp.host.nschild`, the namespace/TAP child (tests import it
from here): the same module object, so setting one of its attributes here sets it there."""

import sys

from .host import nschild

sys.modules[__name__] = nschild
