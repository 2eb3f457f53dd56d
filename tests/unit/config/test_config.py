"""NetworkConfig validation: every bad value raises ConfigError naming its field, in one line."""

import pytest

from aioslirp import ConfigError, NetworkConfig


@pytest.mark.parametrize("kw, field", [
    (dict(cidr="not-a-net"), "cidr"),
    (dict(cidr="10.0.0.0/30"), "cidr"),
    (dict(cidr="224.0.0.0/24"), "cidr"),
    (dict(cidr="127.0.0.0/24"), "cidr"),
    (dict(cidr="0.0.0.0/24"), "cidr"),
    (dict(gateway="10.0.3.2"), "gateway"),
    (dict(dns="10.0.2.2"), "dns"),
    (dict(guest="10.0.2.3"), "guest"),
    (dict(mtu=575), "mtu"),
    (dict(mtu=65521), "mtu"),
    (dict(dns_upstreams=[("nope", 53)]), "dns_upstreams"),
    (dict(dns_upstreams=[("127.0.0.1", 99999)]), "dns_upstreams"),
    (dict(dns_upstreams=["127.0.0.1:0"]), "dns_upstreams"),
    (dict(dns_search=["bad domain!"]), "dns_search"),
    (dict(udp_idle_timeout="x"), "udp_idle_timeout"),
    (dict(dns_timeout=0), "dns_timeout"),
    (dict(max_flows="many"), "max_flows"),
    (dict(gateway_mac="52:55:0a:00:02"), "gateway_mac"),
    (dict(trace_level="spans"), "trace_level"),
    (dict(trace_level=None), "trace_level"),
])
def test_bad_values_name_their_field(kw, field):
    with pytest.raises(ConfigError) as err:
        NetworkConfig(**kw).validate()
    assert err.value.field == field
    assert str(err.value).startswith(field + ": ") and "\n" not in str(err.value)


def test_defaults_and_normalisation():
    c = NetworkConfig(cidr="10.0.3.77/24", dns_upstreams=["127.0.0.53", "[::1]:5353", ("127.0.0.1", "5300")],
                      dns_search=["corp.example", "lab"]).validate()
    assert str(c.cidr) == "10.0.3.0/24"
    assert (str(c.gateway), str(c.dns), str(c.guest)) == ("10.0.3.2", "10.0.3.3", "10.0.3.15")
    assert c.dns_upstreams == [("127.0.0.53", 53), ("::1", 5353), ("127.0.0.1", 5300)]
    assert c.gateway_mac_bytes == bytes.fromhex("52550a000202")
    assert c.trace_level == "flows"
    assert NetworkConfig(trace_level=" Timeline ").validate().trace_level == "timeline"


def test_trace_level_option_sets_the_field_and_a_bad_one_is_one_line(capsys):
    """``--trace-level`` on the commands that take --trace: into ``NetworkConfig.trace_level``;
    a value not among flows/timeline/frames is one line naming the option (exit 2)."""
    from aioslirp.cli.main import build_parser, config_from_args

    parser = build_parser()
    for cmd in (["run"], ["attach", "1"], ["qemu", "--socket", "x.sock"]):
        assert config_from_args(parser.parse_args([*cmd, "--trace-level", "frames"])).trace_level == "frames"
        assert config_from_args(parser.parse_args(cmd)).trace_level == "flows"
    with pytest.raises(SystemExit) as exc:
        parser.parse_args(["run", "--trace-level", "every"])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--trace-level" in err[0] and "'every'" in err[0]


@pytest.mark.parametrize("field", ["udp_idle_timeout", "icmp_idle_timeout", "tcp_idle_timeout", "tcp_linger",
                                   "tcp_connect_timeout", "reassembly_timeout", "new_flow_rate"])
@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_nan_and_infinite_durations_are_refused_naming_the_field(field, value):
    with pytest.raises(ConfigError) as err:
        NetworkConfig(**{field: value}).validate()
    assert str(err.value).startswith(field + ":")


# ------------------------------------------------------------------ egress_deny_builtin (issue 29)
def test_builtin_deny_list_new_name_without_warning(recwarn):
    from aioslirp.config.policy import EgressPolicy

    c = NetworkConfig(egress_deny_builtin=["169.254.169.254"]).validate()
    assert c.egress_deny_builtin == ["169.254.169.254/32"]
    assert NetworkConfig().validate().egress_deny_builtin == ["169.254.0.0/16", "fe80::/10", "fd00:ec2::254/128"]
    p = EgressPolicy.from_config(c)
    assert not p.allows("169.254.169.254") and p.allows("169.254.1.1")
    assert [w for w in recwarn if issubclass(w.category, DeprecationWarning)] == []
    with pytest.raises(ConfigError) as err:
        NetworkConfig(egress_deny_builtin=["nope"]).validate()
    assert err.value.field == "egress_deny_builtin"


def test_builtin_deny_list_old_name_still_works_with_a_deprecation_warning():
    from aioslirp.config.policy import EgressPolicy

    with pytest.warns(DeprecationWarning, match=r"egress_default_deny is deprecated: it is now egress_deny_builtin") as w:
        c = NetworkConfig(egress_default_deny=["169.254.169.254"])
    assert w[0].filename == __file__  # points at the caller
    assert c.validate().egress_deny_builtin == ["169.254.169.254/32"]
    assert not EgressPolicy.from_config(c).allows("169.254.169.254")
    assert EgressPolicy.from_config(c).allows("169.254.1.1")
    with pytest.warns(DeprecationWarning, match="egress_deny_builtin") as w:
        assert c.egress_default_deny == ["169.254.169.254/32"]  # the attribute too
    assert w[0].filename == __file__
    with pytest.warns(DeprecationWarning):
        c.egress_default_deny = []
    assert c.egress_deny_builtin == [] and EgressPolicy.from_config(c).allows("169.254.169.254")


def test_builtin_deny_list_both_names_is_one_line_error():
    with pytest.warns(DeprecationWarning), pytest.raises(ConfigError) as err:
        NetworkConfig(egress_default_deny=[], egress_deny_builtin=[])
    assert err.value.field == "egress_default_deny" and "egress_deny_builtin" in str(err.value)
    assert "\n" not in str(err.value)
