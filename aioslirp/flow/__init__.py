"""Flows and the flow table: :class:`~aioslirp.flow.base.Flow` (the protocol every flow follows)
and :func:`~aioslirp.flow.base.flow_key`, :class:`~aioslirp.flow.table.FlowTable` (look-up,
dirty-set flush, eviction, the one idle sweep) and :class:`~aioslirp.flow.guard.Guard`
(admission of new guest flows)."""
