"""A guest's identity: the ``name`` and ``labels`` of a :class:`~aioslirp.stack.Stack`
(``Stack(name=..., labels=...)``, ``stack.identity``).

Many guests served from one process are told apart by it: every audit record, span, lifecycle
event, :class:`~aioslirp.flow.info.FlowInfo` and the stack's log lines about that guest carry
it. Everything a record needs is computed here once, at construction (:attr:`GuestIdentity.audit_fields`,
:attr:`GuestIdentity.span_attributes`, :attr:`GuestIdentity.log_prefix`, :attr:`GuestIdentity.log_extra`),
so that carrying it costs a dict update per record and nothing per frame.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from types import MappingProxyType

from ..errors import ConfigError

__all__ = ["GuestIdentity", "MAX_LABELS", "MAX_LABEL_VALUE", "MAX_NAME", "NO_IDENTITY"]

#: Longest name, characters.
MAX_NAME = 64
#: Most labels.
MAX_LABELS = 32
#: Longest label value, characters.
MAX_LABEL_VALUE = 256
#: A label key: an OpenTelemetry attribute name (ASCII letters, digits, ``_``, ``-``, ``.``;
#: starting with a letter; at most 64 characters).
_KEY = re.compile(r"[A-Za-z][A-Za-z0-9_.\-]{0,63}")

_EMPTY: Mapping[str, str] = MappingProxyType({})


class GuestIdentity:
    """The name and labels of one guest (one stack); immutable.

    Args:
        name: ``None`` (no name: records carry no guest field) or non-empty printable text of at
            most :data:`MAX_NAME` characters.
        labels: ``None`` or a mapping ``str -> str`` of at most :data:`MAX_LABELS` pairs; keys like
            OpenTelemetry attribute names (``[A-Za-z][A-Za-z0-9_.-]*``, at most 64 characters),
            values printable text of at most :data:`MAX_LABEL_VALUE` characters.

    Raises:
        ConfigError: one line naming ``name`` or ``labels`` (``labels[KEY]`` for a bad value).

    Attributes:
        name: the name, or ``None``.
        labels: a read-only mapping ``str -> str`` (empty when none).
        audit_fields: what each audit record and event gets: ``{"guest_name": name, "labels":
            {...}}``, each only when set (``{}`` when neither).
        span_attributes: what each span gets: ``aioslirp.guest.name`` and
            ``aioslirp.guest.label.<key>`` (``{}`` when neither).
        log_prefix: ``"[name] "`` (``""`` without a name), put before the stack's log messages.
        log_extra: the ``extra`` of those log records: ``guest_name`` and ``guest_labels``
            (``None`` / ``{}`` when unset), for a log formatter or filter.
    """

    __slots__ = ("name", "labels", "audit_fields", "span_attributes", "log_prefix", "log_extra")

    name: str | None
    labels: Mapping[str, str]
    audit_fields: dict
    span_attributes: dict
    log_prefix: str
    log_extra: dict

    def __init__(self, name: str | None = None, labels: Mapping[str, str] | None = None) -> None:
        if name is not None:
            if not isinstance(name, str):
                raise ConfigError("name", f"{name!r} is not text")
            if not name or not name.isprintable() or len(name) > MAX_NAME or name != name.strip():
                raise ConfigError("name", f"{name!r:.80} must be printable text of 1 to {MAX_NAME} characters "
                                          "without leading or trailing spaces")
        checked: dict[str, str] = {}
        if labels is not None:
            if not isinstance(labels, Mapping):
                raise ConfigError("labels", f"{type(labels).__name__} is not a mapping of str to str")
            if len(labels) > MAX_LABELS:
                raise ConfigError("labels", f"{len(labels)} labels; at most {MAX_LABELS}")
            for key, value in labels.items():
                if not isinstance(key, str) or not _KEY.fullmatch(key):
                    raise ConfigError("labels", f"key {key!r} is not an attribute name (a letter, then letters, "
                                                "digits, '_', '-' or '.'; at most 64 characters)")
                if not isinstance(value, str) or not value.isprintable():
                    raise ConfigError(f"labels[{key}]", f"{value!r:.80} is not printable text")
                if len(value) > MAX_LABEL_VALUE:
                    raise ConfigError(f"labels[{key}]", f"{len(value)} characters; at most {MAX_LABEL_VALUE}")
                checked[key] = value
        set_ = object.__setattr__
        set_(self, "name", name)
        set_(self, "labels", MappingProxyType(checked) if checked else _EMPTY)
        audit: dict = {}
        span: dict = {}
        if name is not None:
            audit["guest_name"] = name
            span["aioslirp.guest.name"] = name
        if checked:
            audit["labels"] = dict(checked)
            for key, value in checked.items():
                span["aioslirp.guest.label." + key] = value
        set_(self, "audit_fields", audit)
        set_(self, "span_attributes", span)
        set_(self, "log_prefix", f"[{name}] " if name is not None else "")
        set_(self, "log_extra", {"guest_name": name, "guest_labels": dict(checked)})

    def __bool__(self) -> bool:
        """True when a name or a label is set."""
        return bool(self.audit_fields)

    def __setattr__(self, name: str, value) -> None:
        raise AttributeError(f"GuestIdentity is immutable: {name!r} cannot be set")

    def __eq__(self, other) -> bool:
        if not isinstance(other, GuestIdentity):
            return NotImplemented
        return self.name == other.name and dict(self.labels) == dict(other.labels)

    def __hash__(self) -> int:
        return hash((self.name, tuple(sorted(self.labels.items()))))

    def __repr__(self) -> str:
        return f"GuestIdentity(name={self.name!r}, labels={dict(self.labels)!r})"


#: The identity of a stack made without a name or labels.
NO_IDENTITY = GuestIdentity()
