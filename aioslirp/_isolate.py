"""Old import path of :mod:`aioslirp.host.isolate` (the test suite, the benchmarks and the
fuzzers import it from here): the same module object."""

import sys

from .host import isolate

sys.modules[__name__] = isolate
