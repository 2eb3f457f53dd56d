"""Old import path of :mod:`aioslirp.host.netns` (``aioslirp run`` / ``aioslirp attach``, see
there): the same module object."""

import sys

from .host import netns

sys.modules[__name__] = netns
