"""Old import path of :mod:`aioslirp.cli.slirp4netns`, the slirp4netns drop-in (the
``aioslirp-slirp4netns`` console script of older installs and the tests import it from here):
the same module object."""

import sys

from .cli import slirp4netns

if __name__ == "__main__":
    sys.exit(slirp4netns.main())
sys.modules[__name__] = slirp4netns
