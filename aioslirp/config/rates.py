"""Byte rates as the configuration takes them: :func:`parse_rate` (``--rate-limit``, ``rate_up`` /
``rate_down``)."""

from __future__ import annotations

from ..errors import ConfigError

__all__ = ["parse_rate", "parse_rate_limit"]

_RATE_UNITS = {  # suffix -> bytes per second per unit (lower case; "b" alone is bytes)
    "": 1, "b": 1, "bps": 1 / 8, "bit": 1 / 8,
    "k": 1000, "kb": 1000, "kbit": 125, "kbps": 125, "kib": 1024,
    "m": 1000 ** 2, "mb": 1000 ** 2, "mbit": 125000, "mbps": 125000, "mib": 1 << 20,
    "g": 1000 ** 3, "gb": 1000 ** 3, "gbit": 125000000, "gbps": 125000000, "gib": 1 << 30,
}


def parse_rate(text, field: str) -> float:
    """A byte rate from ``text``: bytes per second (float).

    Accepts a number (bytes/s) or a number and a unit: ``B``, ``kB``/``k``, ``MB``/``M``,
    ``GB``/``G`` (powers of 1000 bytes), ``KiB``, ``MiB``, ``GiB`` (powers of 1024 bytes),
    ``bit``, ``kbit``, ``mbit``, ``gbit`` (and ``bps``, ``kbps``... : bits, powers of 1000);
    case-insensitive, per second implied (``10mbit`` = 1,250,000 bytes/s). A number (int or
    float) is taken as bytes/s. Raises :class:`~aioslirp.errors.ConfigError` naming ``field``
    when it is not one, or not above 0 and finite.
    """
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        value = float(text)
    else:
        s = str(text).strip().lower().removesuffix("/s")
        i = len(s)
        while i and not (s[i - 1].isdigit() or s[i - 1] == "."):
            i -= 1
        unit = _RATE_UNITS.get(s[i:].strip())
        try:
            value = float(s[:i]) * unit if unit is not None else None
        except ValueError:
            value = None
        if value is None:
            raise ConfigError(field, f"{text!r} is not a rate (e.g. 2MB, 500kbit, 10mbit, or bytes per second)")
    if not 0 < value < float("inf"):
        raise ConfigError(field, f"{text!r}: must be a positive rate")
    return value




def parse_rate_limit(text: str, option: str = "--rate-limit") -> dict:
    """``up=RATE,down=RATE`` (either or both) -> ``{"rate_up": bytes/s, "rate_down": bytes/s}``.

    Raises :class:`ConfigError` naming ``option`` (and the direction) for a bad item or rate.
    """
    out: dict = {}
    for item in str(text).split(","):
        item = item.strip()
        if not item:
            continue
        name, sep, value = item.partition("=")
        name = name.strip().lower()
        if not sep or name not in ("up", "down"):
            raise ConfigError(option, f"{item!r}: expected up=RATE or down=RATE (e.g. up=10mbit,down=2MB)")
        out["rate_" + name] = parse_rate(value, f"{option} {name}")
    if not out:
        raise ConfigError(option, f"{text!r}: expected up=RATE and/or down=RATE")
    return out
