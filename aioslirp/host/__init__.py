"""Process and namespace plumbing: everything that forks, enters a namespace, creates a
device or handles a process's signals.

* :mod:`.netns`: ``aioslirp run`` and ``aioslirp attach`` (:func:`~aioslirp.host.netns.run_in_namespace`,
  :func:`~aioslirp.host.netns.attach`);
* :mod:`.spawn`: :func:`aioslirp.spawn`, a command in its own namespaces behind its own stack
  (a :class:`~aioslirp.host.spawn.Guest`);
* :mod:`.nschild`: the one namespace/TAP child process behind ``run``, ``attach`` and the
  slirp4netns drop-in;
* :mod:`.slirp4netns`: serving a namespace with slirp4netns's ready/exit fd protocol;
* :mod:`.isolate`, :mod:`.sandbox`: a loopback-only namespace for tests; the drop-in's
  ``--enable-sandbox`` / ``--enable-seccomp``;
* :mod:`.signals`: :class:`~aioslirp.host.signals.GracefulStop`, ``aioslirp run``'s SIGTERM.

Nothing below :mod:`aioslirp.stack` imports this package (the import-linter contract in
``pyproject.toml`` says so). The TAP device's ioctls are on the transport floor,
:mod:`aioslirp.transport.tapdev`, next to :class:`~aioslirp.transport.tap.TapTransport`, which
drives the fd; the namespace children import them from there.
"""
