"""Old import path of :mod:`aioslirp.cli.trace_report` (``aioslirp trace-report``): the same
module object."""

import sys

from .cli import trace_report

sys.modules[__name__] = trace_report
