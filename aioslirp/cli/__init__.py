"""The commands: ``aioslirp`` (:mod:`aioslirp.cli.main`: ``run``, ``attach``, ``qemu``, ``demo``,
``trace-report``), the slirp4netns drop-in ``aioslirp-slirp4netns`` (:mod:`.slirp4netns`), the
demo (:mod:`.demo`) and the trace report (:mod:`.trace_report`).

``aioslirp.cli:main``, ``build_parser`` and ``config_from_args`` keep their old import path
(the names bound here are the functions: ``aioslirp.cli.main`` is the function, the module is
``sys.modules["aioslirp.cli.main"]``). Importing this package stays light (no asyncio, no
stack): ``aioslirp-slirp4netns --help``, which RootlessKit and Podman run before every start,
goes through it.
"""

from .main import build_parser, config_from_args, main

__all__ = ["main", "build_parser", "config_from_args"]
