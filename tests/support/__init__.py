"""Helpers shared by the test folders; no test module imports another test module.

``tests/`` is on ``sys.path`` (``pythonpath`` in pyproject's ``[tool.pytest.ini_options]``), so a
test anywhere under it writes ``from support.frames import ...``.

* :mod:`support.frames`: guest frames built with dpkt, the test network's addresses, checksums
  computed independently of aioslirp;
* :mod:`support.stacks`: a Stack served in this process over a socketpair, the guest end of it;
* :mod:`support.fake_clock`: a Stack on an event loop whose clock the test moves;
* :mod:`support.tcp_conn`: the sans-IO TCP endpoint driven by hand, a lossy simulated wire;
* :mod:`support.servers`: real host servers on loopback (data, UDP echo, DNS);
* :mod:`support.egress_world`: the egress tests' DNS and web servers on documentation addresses;
* :mod:`support.namespaces`: addresses on the test namespace's ``lo``, processes in namespaces;
* :mod:`support.guests`: a real guest under ``aioslirp run`` for each address family;
* :mod:`support.qemu`, :mod:`support.vms`: QEMU guests (also used by benchmarks/qemu_vs_passt.py);
* :mod:`support.worldvenv`: a virtual environment an unprivileged user can run;
* :mod:`support.prereqs`: :func:`~support.prereqs.need` (skip here, fail under CI);
* :mod:`support.paths`: the checkout, ``tests/``, ``../shared``;
* ``guest_programs/``: programs run by path inside a guest's namespace (they import nothing of
  the tests).
"""
