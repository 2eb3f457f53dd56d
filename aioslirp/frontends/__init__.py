"""Front ends: everything that builds a :class:`~aioslirp.stack.Stack` and serves it a guest.

* :mod:`.spawn`: :func:`aioslirp.spawn`, a command in its own namespaces behind its own stack
  (a :class:`~aioslirp.frontends.spawn.Guest`);
* :mod:`.netns`: ``aioslirp run`` and ``aioslirp attach``
  (:func:`~aioslirp.frontends.netns.run_in_namespace`, :func:`~aioslirp.frontends.netns.attach`);
* :mod:`.slirp4netns`: serving a namespace with slirp4netns's ready/exit fd protocol (the
  drop-in's process side);
* :mod:`.qemu`: :class:`~aioslirp.frontends.qemu.QemuServer`, QEMU's ``-netdev stream`` /
  ``dgram`` sockets;
* :mod:`.api`: the slirp4netns-compatible control socket (``--api-socket``).

They stand on the stack and on the process plumbing of :mod:`aioslirp.host` (the namespace
child, signals, the sandbox); the command line (:mod:`aioslirp.cli`) is the only floor above.
"""
