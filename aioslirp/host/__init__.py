"""Process and namespace plumbing: everything that forks, enters a namespace, configures an
interface or handles a process's signals. It builds no stack (the front ends that do are
:mod:`aioslirp.frontends`).

* :mod:`.nschild`: the one namespace/TAP child process behind ``run``, ``attach`` and the
  slirp4netns drop-in;
* :mod:`.nsbase`: what the namespace commands share: :class:`~aioslirp.host.nsbase.NamespaceError`,
  the set-up timeout, the child's command line;
* :mod:`.ifconfig`: an interface's address, route and IPv6 sysctls, set inside the namespace;
* :mod:`.isolate`, :mod:`.sandbox`: a loopback-only namespace for tests; the drop-in's
  ``--enable-sandbox`` / ``--enable-seccomp``;
* :mod:`.signals`: :class:`~aioslirp.host.signals.GracefulStop`, ``aioslirp run``'s SIGTERM.

Nothing below the front ends imports this package (the import-linter contract in
``pyproject.toml`` says so). The TAP device's ioctls are on the transport floor,
:mod:`aioslirp.transport.tapdev`, next to :class:`~aioslirp.transport.tap.TapTransport`, which
drives the fd; the namespace children import them from there.
"""
