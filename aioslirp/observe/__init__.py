"""What a stack tells about itself: spans, metrics, the audit log and its lifecycle events.

* :mod:`.tracing`: spans (one trace per NAT flow) and trace points, the process-wide API; the
  per-stack :class:`~aioslirp.observe.tracer.Tracer` (:mod:`.tracer`, compiled) and where its
  spans go (:mod:`.sink`);
* :mod:`.metrics`: OpenTelemetry instruments read from ``Stack.counters``
  (:func:`~aioslirp.observe.metrics.register`);
* :mod:`.audit`: :class:`~aioslirp.observe.audit.AuditLog`, one record per flow at its end, per
  denial and per DNS decision;
* :mod:`.events`: :class:`~aioslirp.observe.events.Event` and
  :class:`~aioslirp.observe.events.EventLog`, the lifecycle events of ``Stack.events()``.

The stack hands these to its parts when it builds them; none of them imports the stack. The
command-line set-up (``--trace``, ``--otlp``, ``--pcap``) builds stacks, so it is in
:mod:`aioslirp.cli.observe`. Logger names are those of before the move (``aioslirp.tracing``,
``aioslirp.audit``...): log filters keep working.
"""
