"""The benchmark harness's own tools (benchmarks/): the C and Python clients and servers
speak the same protocol over real loopback sockets, and the report computes medians,
ratios to pasta and the issue-7 target verdicts from records.

No timing is asserted: only counts, protocol results and arithmetic on given numbers.
"""

from __future__ import annotations

import gzip
import json
import os
import platform
import shutil
import signal
import socket
import subprocess
import sys

import pytest

from aioslirp import compiled

from support.paths import REPO
from support.prereqs import need

BENCH = REPO / "benchmarks"
sys.path.insert(0, str(BENCH))

import report  # noqa: E402


def _free_ports() -> tuple[int, int]:
    with socket.socket() as t, socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as u:
        t.bind(("127.0.0.1", 0))
        u.bind(("127.0.0.1", 0))
        return t.getsockname()[1], u.getsockname()[1]


def _start_server(argv: list[str]) -> subprocess.Popen:
    p = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
    line = p.stdout.readline()
    assert json.loads(line)["ready"] is True
    return p


def _stop_server(p: subprocess.Popen) -> dict:
    p.send_signal(signal.SIGTERM)
    out, _ = p.communicate(timeout=10)
    return json.loads(out.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def cbench(tmp_path_factory) -> str:
    cc = shutil.which("cc") or shutil.which("gcc")
    need(cc, "no C compiler: the harness falls back to the Python client (apt-get install gcc)")
    exe = tmp_path_factory.mktemp("bench") / "bench"
    subprocess.run([cc, "-O2", "-Wall", "-Werror", "-o", str(exe), str(BENCH / "bench.c")], check=True)
    return str(exe)


def _check_latency(res: dict, mode: str) -> None:
    assert res["mode"] == mode
    assert res["n"] > 0
    assert 0 < res["p50"] <= res["p90"] <= res["p99"] <= res["max"]
    assert res["total"] >= res["n"]


def test_c_client_and_server_over_loopback(cbench):
    tcp, udp = _free_ports()
    srv = _start_server([cbench, "server", "127.0.0.1", str(tcp), str(udp)])
    try:
        results = {}
        for mode, port, extra in (("crr", tcp, []), ("rr", tcp, []), ("udprr", udp, []), ("ccrr", tcp, ["8"])):
            p = subprocess.run([cbench, mode, "127.0.0.1", str(port), "0.3", "0.05", *extra],
                               capture_output=True, text=True, timeout=30)
            assert p.returncode == 0, p.stderr
            res = json.loads(p.stdout)
            _check_latency(res, mode)
            assert res.get("errors", res.get("lost")) == 0
            results[mode] = res
        assert results["ccrr"]["parallel"] == 8
    finally:
        stats = _stop_server(srv)
    # every CRR and concurrent CRR connection, plus the RR connection, reached the server
    assert stats["accepted"] >= results["crr"]["total"] + results["ccrr"]["total"] + 1
    assert stats["open"] == 0


def test_python_client_and_server_over_loopback():
    tcp, udp = _free_ports()
    srv = _start_server([sys.executable, str(BENCH / "hostserver.py"), "127.0.0.1", str(tcp), str(udp)])
    client = [sys.executable, str(BENCH / "client.py")]
    try:
        p = subprocess.run([*client, "probe", "127.0.0.1", str(tcp), "--udp-port", str(udp), "--timeout", "5"],
                           capture_output=True, text=True, timeout=30)
        assert json.loads(p.stdout)["ok"] is True
        for mode, port, extra in (("crr", tcp, []), ("rr", tcp, []), ("udprr", udp, []),
                                  ("ccrr", tcp, ["--parallel", "4"])):
            p = subprocess.run([*client, mode, "127.0.0.1", str(port), "--duration", "0.3", "--warmup", "0.05",
                                *extra], capture_output=True, text=True, timeout=30)
            assert p.returncode == 0, p.stderr
            res = json.loads(p.stdout.strip().splitlines()[-1])
            _check_latency(res, mode)
        idle = subprocess.Popen([*client, "idle", "127.0.0.1", str(tcp), "--count", "200", "--timeout", "20"],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        ready = json.loads(idle.stdout.readline())
        assert ready == {"ready": True, "open": 200, "failed": 0, "setup_s": ready["setup_s"]}
        idle.stdin.write("\n")
        idle.stdin.flush()
        assert json.loads(idle.stdout.readline())["open"] == 200
        assert idle.wait(10) == 0
    finally:
        stats = _stop_server(srv)
    assert stats["accepted"] >= 200


def _rec(backend, test, rnd=0, placement="pinned", **kw):
    return dict({"round": rnd, "placement": placement, "backend": backend, "test": test, "ok": True}, **kw)


def test_report_medians_ratios_and_targets(tmp_path):
    records = []
    for rnd, (a, p, s) in enumerate(((300.0, 100.0, 90.0), (500.0, 100.0, 90.0), (400.0, 200.0, 90.0))):
        records.append(_rec("aioslirp", "crr", rnd, result={"p50": a, "p90": a, "p99": a, "rate": 1.0, "total": 10},
                            cpu_ms_per_1k_conn=50.0))
        records.append(_rec("pasta", "crr", rnd, result={"p50": p, "p90": p, "p99": p, "rate": 1.0}))
        records.append(_rec("slirp4netns-65520", "crr", rnd, result={"p50": s, "p90": s, "p99": s, "rate": 1.0}))
    records += [
        _rec("aioslirp", "tcp_up", result={"gbps": 5.0, "retransmits": 0}, cpu_s_per_gb=2.0),
        _rec("pasta", "tcp_up", result={"gbps": 10.0, "retransmits": 0}, cpu_s_per_gb=0.5),
        _rec("slirp4netns-65520", "tcp_up", result={"gbps": 4.0, "retransmits": 3}, cpu_s_per_gb=1.0),
        _rec("aioslirp", "idle", result={"client": {"open": 10000, "setup_s": 3.0}},
             backend_before={"VmRSS_mb": 30.0}, backend_loaded={"VmRSS_mb": 120.0, "fds": 10016}),
        dict(_rec("pasta", "rr"), ok=False, error="boom"),
    ]
    summary = report.summarize(records)
    a, p = summary["pinned"]["aioslirp"], summary["pinned"]["pasta"]
    assert a["crr_p50"] == 400.0 and a["crr_p50_n"] == 3
    assert p["crr_p50"] == 100.0
    assert a["up_gbps"] == 5.0 and a["up_cpu_s_per_gb"] == 2.0
    assert a["idle_rss_mb"] == 120.0 and a["idle_fds"] == 10016
    assert "rr_p50" not in p  # failed records contribute nothing

    rows = {name: met for _b, name, _v, _l, met in report.targets(summary["pinned"])}
    assert rows["CRR p50 <= 2.0x pasta"] is False  # 400 > 2 x 100
    assert rows["TCP ns->host >= slirp4netns-65520"] is True  # 5 >= 4
    assert rows["CPU/GB ns->host <= 3x pasta"] is False  # 2.0 > 3 x 0.5
    assert rows["RR p50 <= 2.0x pasta"] is None  # no pasta RR figure: no verdict

    meta = {"backends": {"aioslirp": {"version": "0"}, "pasta": {"version": "1"},
                         "slirp4netns-65520": {"version": "2"}},
            "profile": {"rounds": 3, "placements": ["pinned"], "idle_flows": 10000, "idle_budget_s": 20},
            "loadavg_start": [0.1, 0.1, 0.1], "loadavg_end": [0.2, 0.1, 0.1], "ncpu": 2, "pinned_cpu": 1}
    md = report.markdown({"meta": meta, "summary": summary, "records": records})
    assert "| aioslirp | 400 / 400 / 400 (4.00x)" in md
    assert "| aioslirp | 5.00 (0.50x) | 2.00 (4.00x) | 0 |" in md
    assert "| aioslirp | 10000 idle flows < 300 MB RSS | 120 MB (10000 open) | 300 MB | yes |" in md
    assert "pinned pasta rr: boom" in md

    page = tmp_path / "performance.md"
    page.write_text(f"# P\n\nintro\n\n{report.START}\nold\n{report.END}\n\ntail\n")
    report.update_docs(page, md, with_plot=True)
    text = page.read_text()
    assert text.startswith("# P\n\nintro\n\n") and text.endswith(f"{report.END}\n\ntail\n")
    assert "old" not in text and "(4.00x)" in text and "![Benchmark results](performance.png)" in text


def test_run_py_rejects_bad_options_with_one_line():
    p = subprocess.run([sys.executable, str(BENCH / "run.py"), "--backends", "nosuch"],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 2
    assert p.stderr.strip().splitlines() == ["run.py: error: --backends: unknown nosuch"]


def test_interpreter_record_from_sysconfig():
    source_opt = {"CONFIG_ARGS": "'--prefix=/opt/py' '--enable-optimizations' '--with-lto'", "PY_CFLAGS": "-O3"}
    rec = report.interpreter_record("3.11.7", "CPython", "/opt/py/bin/python3.11", source_opt, extension=False)
    assert rec == {"version": "3.11.7", "implementation": "CPython", "executable": "python3.11", "pgo": True,
                   "lto": True, "distribution_build": False, "extension": False}
    # the compiler flags alone are enough, and the extension flag is passed through
    flags = report.interpreter_record("3.12.1", "CPython", "python", {"PY_CFLAGS_NODIST": "-flto -fprofile-use"},
                                      extension=True)
    assert (flags["pgo"], flags["lto"], flags["extension"]) == (True, True, True)
    plain = report.interpreter_record("3.11.7", "CPython", "/x/.venv/bin/python",
                                      {"CONFIG_ARGS": "'--prefix=/opt/python-3.11.7' '--enable-shared'",
                                       "PY_CFLAGS": "-O3 -Wall"}, extension=False)
    assert (plain["pgo"], plain["lto"], plain["executable"]) == (False, False, "python")
    # a distribution's build does not show its PGO/LTO in sysconfig: unknown, not "no"
    distro = report.interpreter_record("3.11.2", "CPython", "/usr/bin/python3",
                                       {"CONFIG_ARGS": "'--enable-shared' '--prefix=/usr'"}, extension=False)
    assert (distro["pgo"], distro["lto"], distro["distribution_build"]) == (None, None, True)
    assert report.interpreter_text(rec) == \
        "Python 3.11.7 (CPython, python3.11, PGO+LTO, no compiled extension)"
    assert "no PGO/LTO" in report.interpreter_text(plain)
    assert "not shown by sysconfig" in report.interpreter_text(distro)
    now = report.current_interpreter()
    # this process's aioslirp: compiled when every module of the compiled path loaded native
    assert now["extension"] is all(compiled.status().values()) and now["version"] == platform.python_version()


def test_ratios_to_the_faster_pasta_per_figure():
    summary = {"pinned": {
        "aioslirp": {"crr_p50": 600.0, "crr_cpu_ms_per_1k": 400.0, "up_gbps": 4.0, "down_gbps": 4.5},
        "pasta": {"crr_p50": 300.0, "crr_cpu_ms_per_1k": 200.0, "up_gbps": 9.0, "down_gbps": 5.0},
        "pasta-2026_07_16": {"crr_p50": 400.0, "crr_cpu_ms_per_1k": 100.0, "up_gbps": 0.5, "down_gbps": 6.0},
        "slirp4netns-65520": {"crr_p50": 100.0, "up_gbps": 20.0},  # not a pasta: never the reference
    }}
    refs = report.references(summary)["pinned"]
    assert refs == {"crr_p50": "pasta", "crr_cpu_ms_per_1k": "pasta-2026_07_16", "up_gbps": "pasta",
                    "down_gbps": "pasta-2026_07_16"}
    assert report.reference_values(summary["pinned"]) == {"crr_p50": 300.0, "crr_cpu_ms_per_1k": 100.0,
                                                          "up_gbps": 9.0, "down_gbps": 6.0}
    rows = {name: (val, met) for b, name, val, _l, met in report.targets(summary["pinned"]) if b == "aioslirp"}
    assert rows["CRR p50 <= 2.0x pasta"] == (600.0, True)  # 600 <= 2 x 300 (the faster pasta's CRR)
    meta = {"backends": {b: {"version": "0"} for b in summary["pinned"]},
            "profile": {"rounds": 1, "placements": ["pinned"]}, "pinned_cpu": 1, "ncpu": 2,
            "interpreter": report.interpreter_record("3.11.2", "CPython", "/usr/bin/python3", {}, False)}
    md = report.markdown({"meta": meta, "summary": summary, "records": []})
    assert "| aioslirp | 600 / – / – (2.00x) | – | – | 400 (4.00x) | – |" in md
    assert "| pasta-2026_07_16 | 400 / – / – (1.33x) | – | – | 100 (1.00x) | – |" in md  # both pastas shown
    assert "| pasta | 9.00 (1.00x) | – | – | 5.00 (0.83x) |" in md
    assert "Ratios to the faster pasta per figure: CRR p50 pasta; CRR backend CPU pasta-2026_07_16." in md
    assert "TCP ns->host pasta; TCP host->ns pasta-2026_07_16." in md
    assert "Python 3.11.2 (CPython, python3, no PGO/LTO, no compiled extension)" in md
    # one pasta: the same ratios, no note
    one = {"pinned": {b: s for b, s in summary["pinned"].items() if b != "pasta-2026_07_16"}}
    meta1 = dict(meta, backends={b: {"version": "0"} for b in one["pinned"]})
    assert "faster pasta per figure:" not in report.markdown({"meta": meta1, "summary": one, "records": []})


def test_pasta_backends_are_named_by_release():
    import backends as B

    assert B.pasta_name("2026_07_16.090d739") == "pasta-2026_07_16"
    assert B.pasta_name("") == "pasta-custom"
    assert B.Pasta().name == "pasta"
    b = B.pasta_from_spec("new=/nonexistent/pasta", ["pasta"])
    assert (b.name, b.binary, b.available()) == ("new", "/nonexistent/pasta", False)
    assert b.argv("NS")[0] == "/nonexistent/pasta"
    assert B.pasta_from_spec("/nonexistent/pasta", ["pasta-custom"]).name == "pasta-custom-2"


@pytest.mark.netns
def test_handler_bulk_smoke(tmp_path):
    """benchmarks/handler_bulk.py end to end with tiny transfers: the 4 rows, every byte checked (figures are noise)."""
    need(os.path.exists("/dev/net/tun"), "/dev/net/tun is missing (load the tun module)")
    out = tmp_path / "hb.json"
    p = subprocess.run([sys.executable, str(BENCH / "handler_bulk.py"), "--size", "2", "--rounds", "1",
                        "--json", str(out)], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr[-2000:]
    lines = p.stdout.splitlines()
    assert lines[0] == "| mode | direction | Gbit/s (median) | CPU s/GB (median) |"
    rows = [line.split(" | ")[:2] for line in lines[2:] if line.startswith("| ")]
    assert rows == [["| nat", "download"], ["| nat", "upload"], ["| identity", "download"], ["| identity", "upload"]]
    result = json.loads(out.read_text())
    assert len(result["records"]) == 4
    assert all(r["bytes"] == 2_000_000 and r["gbps"] > 0 and r["cpu_s"] >= 0 for r in result["records"])


def test_issue16_targets_to_the_faster_pasta_and_the_cpu_split():
    records = [
        _rec("aioslirp", "crr", result={"p50": 300.0, "p90": 1, "p99": 1, "rate": 1.0, "total": 2000},
             cpu_ms_per_1k_conn=300.0, cpu_user_ms_per_1k_conn=180.0, cpu_sys_ms_per_1k_conn=120.0),
        _rec("pasta", "crr", result={"p50": 210.0, "p90": 1, "p99": 1, "rate": 1.0}, cpu_ms_per_1k_conn=160.0),
        _rec("pasta-2026", "crr", result={"p50": 190.0, "p90": 1, "p99": 1, "rate": 1.0}, cpu_ms_per_1k_conn=140.0),
        _rec("aioslirp", "rr", result={"p50": 60.0, "rate": 1.0}),
        _rec("pasta", "rr", result={"p50": 40.0, "rate": 1.0}),
        _rec("aioslirp", "ccrr64", result={"p50": 9.0, "rate": 700.0}),
        _rec("pasta-2026", "ccrr64", result={"p50": 9.0, "rate": 1000.0}),
        _rec("aioslirp", "tcp_up", result={"gbps": 5.0}, cpu_s_per_gb=0.9),
        _rec("pasta", "tcp_up", result={"gbps": 6.0}, cpu_s_per_gb=0.5),
        _rec("slirp4netns-65520", "tcp_up", result={"gbps": 4.9}),
        _rec("aioslirp", "idle", result={"client": {"open": 10000, "setup_s": 3.0}},
             backend_before={"VmRSS_mb": 30.0}, backend_loaded={"VmRSS_mb": 99.0, "fds": 10016}),
    ]
    summary = report.summarize(records)["pinned"]
    assert (summary["aioslirp"]["crr_cpu_user_ms_per_1k"], summary["aioslirp"]["crr_cpu_sys_ms_per_1k"]) == (180.0, 120.0)
    rows = {name: (val, lim, met) for b, name, val, lim, met in report.targets16(summary, 10000)}
    assert rows["CRR p50 <= 1.5x pasta"] == (300.0, "285 us", False)  # 1.5 x 190 (pasta-2026, the faster)
    assert rows["RR p50 <= 1.5x pasta"] == (60.0, "60.0 us", True)  # 60 <= 1.5 x 40
    assert rows["UDP RR p50 <= 1.5x pasta"] == (None, "– us", None)  # no figures: no verdict
    assert rows["CPU per connection <= 2.0x pasta"] == (300.0, "280 ms/1000", False)  # 2 x 140
    assert rows["64 concurrent connections >= 0.7x pasta's rate"] == (700.0, "700 conn/s", True)
    # 0.8 x 6.0 = 4.8 Gbit/s is below slirp4netns-65520's 4.9: the higher floor counts
    assert rows["TCP ns->host >= 0.8x pasta (bookworm) and >= slirp4netns-65520"] == (5.0, "4.90 Gbit/s", True)
    assert rows["CPU/GB ns->host <= 2.0x pasta"] == (0.9, "1.00 s/GB", True)
    assert rows["10,000 idle flows < 100 MB RSS"] == (99.0, "100 MB", True)
    assert "10,000 idle flows < 100 MB RSS" not in {r[1] for r in report.targets16(summary, 2000)}  # quick runs
    meta = {"backends": {b: {"version": "0"} for b in summary}, "profile": {"rounds": 1, "placements": ["pinned"],
            "idle_flows": 10000}, "pinned_cpu": 1, "ncpu": 2,
            "interpreter": report.interpreter_record("3.11.2", "CPython", "/usr/bin/python3", {}, False)}
    md = report.markdown({"meta": meta, "summary": {"pinned": summary}, "records": []})
    assert "### Issue 16 targets (pinned; pasta = the faster pasta per figure)" in md
    assert "| aioslirp | CPU per connection <= 2.0x pasta | 300 | 280 ms/1000 | **no** |" in md
    assert "(2.14x) | 180 / 120 |" in md  # CRR CPU 300 / 140, then its user / system parts


def test_recorded_argv_names_no_directory_of_the_machine():
    import run  # benchmarks/run.py (imports nothing that needs root)
    repo = str(BENCH.parent)
    argv = ["--pasta", f"new={repo}/.cache/peers/passt/pasta", "--build-peers",
            f"{os.path.dirname(repo)}/shared/peers/build.sh", "--rounds", "3"]
    assert run.portable_argv(argv) == ["--pasta", "new=.cache/peers/passt/pasta", "--build-peers",
                                       "../shared/peers/build.sh", "--rounds", "3"]


def test_profile_counts_per_iteration(tmp_path):
    import importlib.util  # benchmarks/profile.py by its path: the stdlib has a module "profile" too
    spec = importlib.util.spec_from_file_location("bench_profile", BENCH / "profile.py")
    bench_profile = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench_profile)
    counts = bench_profile.proc_counts(os.getpid())  # this process: the same files a backend has
    assert {"voluntary_ctxt_switches", "nonvoluntary_ctxt_switches", "syscr", "syscw", "user_s", "sys_s"} <= set(counts)
    assert counts["syscr"] > 0 and counts["user_s"] > 0
    f = tmp_path / "c.json"
    f.write_text(json.dumps({"syscr": 8680, "voluntary_ctxt_switches": 530, "user_s": 0.2501}))
    text = bench_profile.report_counts(f, 1000)
    assert text.splitlines() == ["1000 iterations; per iteration:",
                                 "  syscr                            8.68",
                                 "  voluntary_ctxt_switches          0.53",
                                 "  user_s                          250.1 us"]


def test_many_guests_quick_every_guest_answered():
    """benchmarks/many_guests.py --quick --dhcp: 20 stacks in a service process, a guest each that takes
    a DHCP lease and holds a live flow through its own stack's NAT; the record has every figure and
    every guest was answered."""
    p = subprocess.run([sys.executable, str(BENCH / "many_guests.py"), "--quick", "--dhcp", "--json", "-"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    r = json.loads(p.stdout.strip().splitlines()[-1])
    assert (r["guests"], r["guests_answered"], r["dhcp_leases"]) == (20, 20, 20)
    assert r["flows"] == {"established": 20, "open_in_service": 20, "open_at_end": 20, "resets": 0}
    assert r["serving"] == 20 and r["uvloop"] is True
    for phase in ("baseline", "idle", "flows_open", "load"):
        assert r["memory_mb"][phase]["VmRSS_mb"] > 10  # an interpreter with aioslirp imported, at least
    assert r["memory_mb"]["load"]["VmRSS_mb"] >= r["memory_mb"]["baseline"]["VmRSS_mb"]
    assert r["startup_s"] > 0 and r["startup_ms_per_stack"] == pytest.approx(r["startup_s"] * 1e3 / 20, abs=0.03)
    assert r["requests"]["answered_in_window"] > 0 and r["cpu"]["per_request_us"] is not None
    assert r["cpu"]["service_s"] >= 0 and r["cpu"]["per_guest_us_per_s"] >= 0
    lat = r["latency_us"]
    assert 0 < lat["p50"] <= lat["p90"] <= lat["p99"] <= lat["max"]


def test_many_guests_one_tracer_provider_for_every_stack(tmp_path):
    """--trace: the stacks share one provider; a flow span per guest, told apart by the guest's name."""
    spans = tmp_path / "spans.jsonl"
    p = subprocess.run([sys.executable, str(BENCH / "many_guests.py"), "--quick", "--guests", "5", "--trace",
                        str(spans), "--json", "-"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    r = json.loads(p.stdout.strip().splitlines()[-1])
    assert r["guests_answered"] == 5 and r["trace"] == {"level": "flows", "spans": 5}
    assert r["service_threads"] == 2  # the loop's and the one export thread
    records = [json.loads(line) for line in spans.read_text().splitlines()]
    assert sorted(s["attributes"]["aioslirp.guest.name"] for s in records) == [f"guest-{i}" for i in range(5)]
    assert {s["name"] for s in records} == {"tcp.flow"}
    assert all(s["attributes"]["aioslirp.bytes.from_guest"] > 0 for s in records)


def test_many_guests_rejects_bad_options_with_one_line():
    p = subprocess.run([sys.executable, str(BENCH / "many_guests.py"), "--guests", "0"],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 2
    assert p.stderr.strip().splitlines()[-1] == "many_guests.py: error: --guests: must be > 0"


@pytest.mark.netns
def test_fairness_quick_prints_a_row_per_guest_and_the_figures():
    """benchmarks/fairness.py --quick end to end: the table's rows and the JSON line's shape (figures are noise)."""
    need(os.path.exists("/dev/net/tun"), "/dev/net/tun is missing (load the tun module)")
    p = subprocess.run([sys.executable, str(BENCH / "fairness.py"), "--quick", "--unloaded", "0.5", "--neighbours", "2"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    lines = p.stdout.splitlines()
    assert lines[0].startswith("fair scheduler: on; window 1 s after 0.5 s warm-up; downloads in all ")
    assert " Gbit/s; the loop's process used " in lines[0] and lines[0].endswith(" CPU")
    assert lines[1] == ("| guest | flows | weight | Gbit/s | fair-share ratio | p50 unloaded us | p50 loaded us "
                        "| latency ratio |")
    rows = [line.split(" | ")[:3] for line in lines[3:-1]]
    assert rows == [["| flood", "4", "1"], ["| n1", "1", "1"], ["| n2", "1", "1"], ["| lat1", "-", "1"]]
    res = json.loads(lines[-1])
    assert res["fair"] is True and res["duration"] == 1.0 and res["warmup"] == 0.5
    assert 0 < res["loop_cpu"] < 2.5  # one loop: about one core at most (plus a helper thread or two)
    downloads = [g for g in res["guests"] if g["kind"] == "download"]
    assert [g["guest"] for g in downloads] == ["flood", "n1", "n2"]
    assert all(g["bytes"] > 0 and g["gbps"] > 0 for g in downloads)
    assert abs(sum(g["fair_share_ratio"] for g in downloads) - 3.0) < 1e-9  # the shares add up to the total
    (lat,) = [g for g in res["guests"] if g["kind"] == "latency"]
    assert lat["unloaded_p50_us"] > 0 and lat["loaded_p50_us"] > 0
    assert lat["latency_ratio"] == pytest.approx(lat["loaded_p50_us"] / lat["unloaded_p50_us"])


@pytest.mark.netns
def test_fairness_isolate_serves_the_latency_guest_from_a_process_of_its_own():
    """--isolate: lat1 is served by a service process of its own (no fair-scheduler figures of
    this loop), its round trips measured all the same; the flood and n1 stay in this loop."""
    need(os.path.exists("/dev/net/tun"), "/dev/net/tun is missing (load the tun module)")
    p = subprocess.run([sys.executable, str(BENCH / "fairness.py"), "--quick", "--unloaded", "0.5", "--isolate"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    lines = p.stdout.splitlines()
    assert lines[0].endswith(" CPU; latency guests in a process of their own")
    res = json.loads(lines[-1])
    assert res["isolate"] is True
    by_name = {g["guest"]: g for g in res["guests"]}
    assert [by_name[n]["isolated"] for n in ("flood", "n1", "lat1")] == [False, False, True]
    lat = by_name["lat1"]
    assert lat["express"] == 0 and lat["fair_waits"] == 0 and lat["weight"] is None
    assert lat["samples"][0] > 100 and lat["samples"][1] > 100  # a request a millisecond for 1 s each
    assert lat["unloaded_p50_us"] > 0 and lat["loaded_p50_us"] > 0
    assert by_name["flood"]["bytes"] > 0 and by_name["n1"]["bytes"] > 0


@pytest.mark.netns
def test_fairness_latency_pasta_serves_the_latency_guest_by_pasta():
    """--latency-pasta PASTA: lat1 runs under pasta (a process of its own, the peers' model) and is
    measured the same way; the flood and n1 stay in this loop on the native plane."""
    need(os.path.exists("/dev/net/tun"), "/dev/net/tun is missing (load the tun module)")
    pasta = shutil.which("pasta")
    need(pasta is not None, "pasta is not installed (apt-get install passt)")
    need(shutil.which("unshare") is not None and shutil.which("ip") is not None, "needs unshare and ip")
    # a namespace of its own whose default route is a black hole (TEST-NET-1 on its own veth pair), as
    # benchmarks/run.py makes for pasta: nothing leaves it
    setup = ("ip link set lo up && ip link add bsink0 type veth peer name bsink1 && ip link set bsink1 up && "
             "ip addr add 192.0.2.1/24 dev bsink0 && ip link set bsink0 up && "
             "ip route add default via 192.0.2.254 dev bsink0 && exec \"$@\"")
    p = subprocess.run(["unshare", "-n", "sh", "-c", setup, "sh", sys.executable, str(BENCH / "fairness.py"),
                        "--quick", "--unloaded", "0.5", "--latency-pasta", "pasta"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    lines = p.stdout.splitlines()
    assert lines[0].endswith(f" CPU; latency guests served by {os.path.realpath(pasta)}") or \
        lines[0].endswith(f" CPU; latency guests served by {pasta}")
    res = json.loads(lines[-1])
    by_name = {g["guest"]: g for g in res["guests"]}
    assert [by_name[n]["served_by"] for n in ("flood", "n1", "lat1")] == ["shared loop", "shared loop", "pasta"]
    lat = by_name["lat1"]
    assert lat["express"] == 0 and lat["native_tcp"] is None
    assert lat["samples"][0] > 100 and lat["samples"][1] > 100
    assert by_name["flood"]["native_tcp"] is True and by_name["flood"]["bytes"] > 0


def test_fairness_rejects_bad_options_with_one_line():
    for opts, text in ((["--weights", "nobody=2"], "no guest named 'nobody'"),
                       (["--weights", "n1=0"], "--weights: 'n1=0': expected NAME=POSITIVE_NUMBER"),
                       (["--neighbours", "-1"], "--neighbours: must be at least 0"),
                       (["--unloaded", "0"], "--unloaded must be > 0"),
                       (["--loop-nice", "20"], "--loop-nice: must be 0-19"),
                       (["--loop-nice", "-1"], "--loop-nice: must be 0-19"),
                       (["--latency-pasta", "/nonexistent/pasta"], "--latency-pasta: '/nonexistent/pasta' is not an "
                                                                    "executable"),
                       (["--latency-pasta", "sh", "--isolate"], "--latency-pasta: not with --isolate")):
        p = subprocess.run([sys.executable, str(BENCH / "fairness.py"), *opts], capture_output=True, text=True,
                           timeout=60)
        assert p.returncode != 0
        assert text in p.stderr, p.stderr


@pytest.mark.netns
def test_fairness_latency_pasta_without_a_default_route_is_one_line():
    need(shutil.which("unshare") is not None, "needs unshare")
    p = subprocess.run(["unshare", "-n", sys.executable, str(BENCH / "fairness.py"), "--latency-pasta", "sh"],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 2
    assert p.stderr.strip().splitlines()[-1] == (
        "fairness.py: error: --latency-pasta: pasta needs an IPv4 default route in this namespace (a black hole "
        "will do, as benchmarks/run.py makes)")


# ---- benchmarks/vhost_user.py: CRR/RR inside the QEMU guest --------------------------------------

def _fake_kit(tmp_path):
    """A kit cache whose initramfs.cpio.gz is a host-cpio newc archive holding /init."""
    kit = tmp_path / "kit"
    (kit / "root").mkdir(parents=True)
    (kit / "root" / "init").write_text("#!/bin/sh\n")
    cpio = subprocess.run(["cpio", "-o", "-H", "newc", "--quiet"], input=b"init\n", cwd=kit / "root",
                          capture_output=True, check=True).stdout
    (kit / "initramfs.cpio.gz").write_bytes(gzip.compress(cpio, mtime=0))
    return kit, cpio


def test_guest_bench_is_appended_to_the_kit_initramfs_as_bin_bench_0755(tmp_path):
    """build_guest_bench: the combined initrd starts with the kit's archive byte for byte, and its
    second gzip member is a newc archive that host cpio lists as bin/bench, -rwxr-xr-x, holding
    the static bench binary (which runs)."""
    cc = shutil.which("cc") or shutil.which("gcc")
    need(cc, "no C compiler (apt-get install gcc)")
    need(shutil.which("cpio"), "no cpio (apt-get install cpio)")
    import vhost_user

    kit, kit_cpio = _fake_kit(tmp_path)
    work = tmp_path / "work"
    work.mkdir()
    initrd = vhost_user.build_guest_bench(work, cache=kit)
    combined, kit_gz = initrd.read_bytes(), (kit / "initramfs.cpio.gz").read_bytes()
    assert combined.startswith(kit_gz) and len(combined) > len(kit_gz)
    extra = gzip.decompress(combined[len(kit_gz):])
    assert gzip.decompress(combined) == kit_cpio + extra  # two members, in order (as the kernel reads them)
    listing = subprocess.run(["cpio", "-itv"], input=extra, capture_output=True, check=True).stdout.decode()
    (line,) = listing.strip().splitlines()
    assert line.split()[0] == "-rwxr-xr-x" and line.split()[-1] == "bin/bench"
    out = tmp_path / "out"
    out.mkdir()
    subprocess.run(["cpio", "-id", "--quiet"], input=extra, cwd=out, check=True)
    got = out / "bin" / "bench"
    assert got.read_bytes() == (work / "bench").read_bytes()
    assert got.stat().st_mode & 0o7777 == 0o755
    assert b"/ld-linux" not in got.read_bytes()  # static: no program interpreter (the guest has no glibc)
    p = subprocess.run([str(got)], capture_output=True, text=True, timeout=10)
    assert p.returncode != 0 and p.stderr.startswith("usage: bench server")
    assert (kit / "initramfs.cpio.gz").read_bytes() == kit_gz  # the kit is left untouched


def test_newc_archive_entries_and_trailer():
    from support import qemu

    raw = qemu.newc_archive({"/bin/x": (b"abcde", 0o750)})
    assert len(raw) % 4 == 0
    assert raw[:6] == b"070701"
    fields = [int(raw[6 + 8 * i:14 + 8 * i], 16) for i in range(13)]
    assert fields[1] == 0o100750 and fields[6] == 5 and fields[11] == len(b"bin/x\0")
    assert raw[110:116] == b"bin/x\0" and raw[116:121] == b"abcde"
    assert raw.rstrip(b"\0").endswith(b"TRAILER!!!")


def test_vhost_user_guest_script_and_latency_parse():
    import vhost_user

    script = vhost_user.guest_script(["crr", "rr"], 4, 1, 2, 5201, 3.0, 1.0)
    assert "iperf3" not in script
    assert "bench crr 10.0.2.2 5201 3 1 " in script and "bench rr 10.0.2.2 5201 3 1 " in script
    assert "UP_RC" in vhost_user.guest_script(["iperf3"], 4, 1, 2, 0, 3.0, 1.0)
    line = json.dumps({"mode": "crr", "n": 10, "p50": 1500.5, "errors": 0})
    assert vhost_user.parse_latency({"CRR_RC": "0", "CRR": line}, "crr")["p50"] == 1500.5
    assert vhost_user.parse_latency({"CRR_RC": "1", "CRR": line}, "crr") is None
    assert vhost_user.parse_latency({"CRR_RC": "0", "CRR": ""}, "crr") is None
    assert vhost_user.parse_latency({"RR_RC": "0", "RR": line}, "rr") is None  # another mode's line
    assert vhost_user.parse_latency({"CRR_RC": "0", "CRR": line.replace('"n": 10', '"n": 0')}, "crr") is None


def test_vhost_user_table_crr_rr_columns_and_ratios_to_passt_vhost_user():
    import vhost_user

    figures = {"aioslirp-vhost-user": (900.0, 1100.0, 4.0, 1800.0, 300.0),
               "aioslirp-stream": (350.0, 700.0, 16.0, 1000.0, 240.0),
               "passt-vhost-user": (500.0, 850.0, 3.0, 1200.0, 200.0),
               "passt-stream": (300.0, 650.0, 4.0, 1300.0, 160.0)}
    records = []
    for rnd, scale in ((0, 1.0), (1, 2.0)):
        for backend, (up, down, cpu, crr, rr) in figures.items():
            records.append({"backend": backend, "mtu": 1500, "smp": 1, "round": rnd, "ok": True,
                            "iperf_up_mbit": up, "iperf_down_mbit": down, "backend_cpu_s_per_gb": cpu,
                            "crr_p50_us": crr * scale, "rr_p50_us": rr * scale})
    records.append({"backend": "passt-stream", "mtu": 1500, "smp": 1, "round": 2, "ok": False})
    vhost_user.add_ratios(records)
    assert records[0]["crr_p50_vs_passt_vhost_user"] == 1.5 and records[0]["rr_p50_vs_passt_vhost_user"] == 1.5
    assert records[7]["rr_p50_vs_passt_vhost_user"] == 0.8  # round 1 against round 1's passt
    assert "crr_p50_vs_passt_vhost_user" not in records[-1]
    md = vhost_user.table(records)
    assert "| CRR p50 (µs) | CRR / passt vhost-user | RR p50 (µs) | RR / passt vhost-user |" in md
    assert "| aioslirp-vhost-user | 1500 | 2/2 | 900 | 1100 | 4.00 | 2700 | 1.50x | 450 | 1.50x |" in md
    assert "| passt-vhost-user | 1500 | 2/2 | 500 | 850 | 3.00 | 1800 | 1.00x | 300 | 1.00x |" in md
    assert "| passt-stream | 1500 | 2/3 | 300 | 650 | 4.00 | 1950 | 1.08x | 240 | 0.80x |" in md
    assert ("MTU 1500: aioslirp vhost-user / passt-vhost-user p50 in the guest: 1.50x CRR, 1.50x RR "
            "(target <= 1.0x both: not met)") in md
    assert "aioslirp vhost-user / passt-vhost-user: 1.80x up, 1.29x down (target >= 1.1x both ways: met)" in md

    latency_only = [{k: v for k, v in r.items() if not k.startswith(("iperf", "backend_cpu"))} for r in records]
    md = vhost_user.table(latency_only)  # --tests crr,rr: no throughput figure, no throughput verdict
    assert "| aioslirp-vhost-user | 1500 | 2/2 | - | - | - | 2700 | 1.50x | 450 | 1.50x |" in md
    assert " up, " not in md and "p50 in the guest: 1.50x CRR, 1.50x RR" in md


def test_vhost_user_rejects_bad_options_with_one_line():
    for opts, text in ((["--tests", "crr,nosuch"], "vhost_user.py: error: --tests: unknown 'nosuch'"),
                       (["--latency-seconds", "0"], "vhost_user.py: error: --latency-seconds: 0 is not > 0"),
                       (["--backends", "qemu"], "vhost_user.py: error: --backends: unknown 'qemu'"),
                       (["--smp", "x"], "vhost_user.py: error: argument --smp: 'x' is not a comma list of integers"),
                       (["--nope"], "vhost_user.py: error: unrecognized arguments: --nope")):
        p = subprocess.run([sys.executable, str(BENCH / "vhost_user.py"), *opts], capture_output=True, text=True,
                           timeout=60)
        assert p.returncode == 2
        (line,) = p.stderr.strip().splitlines()
        assert line.startswith(text), line


def test_run_py_checks_the_vm_sections_options_first():
    """``run.py --vm ARGS`` checks ARGS as vhost_user.py would before its own run starts (which
    takes minutes): one line naming --vm and the option, status 2."""
    for opts, text in (("--backends nosuch", "run.py: error: --vm: --backends: unknown 'nosuch'"),
                       ("--rounds x", "run.py: error: --vm: argument --rounds: invalid int value: 'x'"),
                       ("--bogus 3", "run.py: error: --vm: unrecognized arguments: --bogus 3")):
        p = subprocess.run([sys.executable, str(BENCH / "run.py"), "--vm", opts], capture_output=True, text=True,
                           timeout=60)
        assert p.returncode == 2, p.stderr
        (line,) = p.stderr.strip().splitlines()
        assert line.startswith(text), line


def test_idle_test_runs_in_a_session_of_its_own():
    """The idle test gets a new namespace and backend: after the connection tests the guest's own
    TIME-WAIT sockets slow its connect() (run.session_groups' docstring), whatever the backend."""
    import run

    every = list(run.TEST_NAMES)
    assert run.session_groups(every, with_idle=True) == [[t for t in every if t != "idle"], ["idle"]]
    assert run.session_groups(every, with_idle=False) == [[t for t in every if t != "idle"]]
    assert run.session_groups(["idle"], with_idle=True) == [["idle"]]
    assert run.session_groups(["crr"], with_idle=True) == [["crr"]]
