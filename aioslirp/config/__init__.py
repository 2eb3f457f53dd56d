"""Configuration of one :class:`~aioslirp.Stack`: validated values, no behaviour.

* :mod:`.network`: :class:`NetworkConfig`, the settings of the virtual network, and
  :func:`parse_hostport`;
* :mod:`.ipv6`: :class:`~aioslirp.config.ipv6.Ipv6Config`, the IPv6 router variables built
  from a ``NetworkConfig``;
* :mod:`.policy`: :class:`~aioslirp.config.policy.EgressPolicy`, the compiled ``--allow`` /
  ``--deny`` rules;
* :mod:`.limits`: the ``--limit NAME=VALUE`` fields and their parsing;
* :mod:`.rates`: byte rates (``--rate-limit``, ``rate_up`` / ``rate_down``).
* :mod:`.forward`: :class:`~aioslirp.config.forward.PortForward`, a port forward host -> guest,
  and :func:`~aioslirp.config.forward.parse_publish` (``-p/--publish``).

They import only :mod:`aioslirp.errors` (where :class:`ConfigError` lives) and one another,
never a layer above. The error they raise, :class:`~aioslirp.errors.ConfigError`, is
``aioslirp.ConfigError``.
"""

from .network import DEFAULT_GATEWAY_MAC, NetworkConfig, parse_hostport  # noqa: F401

__all__ = ["NetworkConfig", "parse_hostport"]
