"""Renderer behaviour: units, secrets, containers, proxy config, routers, digests, quoting."""

from __future__ import annotations

import json
import os
import re
from dataclasses import replace
from pathlib import Path

import pytest
from conftest import ROOT, TEST_TOPOLOGIES, flag_pairs, topology

from hgxserve.base.digests import tree_digest
from hgxserve.base.units import exec_line, quote_word
from hgxserve.proxy.config import load_proxy_config
from hgxserve.render import (
    HostRender,
    RenderedFile,
    RenderError,
    render_host,
    render_topology,
)
from hgxserve.topology import load_topology

ALL_TOPOLOGIES = sorted(ROOT.glob("topologies/**/*.yml")) + sorted(TEST_TOPOLOGIES.glob("*.yml"))


def test_units_in_start_order_and_files_keyed_by_host_path():
    host = render_host(topology("h20-v4flash-4p4d.yml"), "h20-a")
    assert [u.name for u in host.units] == [
        "hgxserve-prefill-0.service",
        "hgxserve-decode-0.service",
        "hgxserve-proxy.service",
    ]
    assert sorted(host.files) == [
        "/etc/hgxserve/firewall.nft",
        "/etc/hgxserve/proxy.json",
        "/etc/systemd/system/hgxserve-decode-0.service",
        "/etc/systemd/system/hgxserve-prefill-0.service",
        "/etc/systemd/system/hgxserve-proxy.service",
    ]
    assert all(f.mode == 0o644 for f in host.files.values())
    proxy = host.units[-1]
    assert proxy.engine is None and proxy.role == "proxy"
    assert "After=network-online.target hgxserve-prefill-0.service hgxserve-decode-0.service" in (
        proxy.content
    )


REQUIRED_ENGINE_LINES = [
    "LimitMEMLOCK=infinity",
    "LimitNOFILE=1048576",
    "KillMode=control-group",
    "StartLimitBurst=3",
    "NoNewPrivileges=yes",
    "PrivateTmp=yes",
    "After=network-online.target",
]


@pytest.mark.parametrize("path", ALL_TOPOLOGIES, ids=lambda p: p.stem)
def test_engine_units_carry_limits_checks_and_pinned_caches(path: Path):
    topo = load_topology(path)
    for rendered in render_topology(topo).values():
        for unit in rendered.units:
            if unit.engine is None or unit.role == "watch":
                continue
            lines = unit.content.splitlines()
            for line in REQUIRED_ENGINE_LINES:
                assert line in lines, (unit.name, line)
            engine = topo.engines[unit.engine]
            # a multi-node engine is restarted as a whole by its watcher, never by systemd
            assert ("Restart=on-failure" in lines) != engine.is_multi_node, unit.name
            assert f"TimeoutStartSec={engine.start_timeout_s}" in lines
            gpus = ",".join(map(str, unit.gpus))
            assert (
                f"ExecStartPre=/opt/hgxserve/bin/hgxserve weights check-marker {topo.model.path}"
                in lines
            )
            # a venv engine runs as the engine user; the GPU checks keep root (`+`): they must
            # see every user's processes. A container engine's podman is root's.
            unprivileged = not engine.runtime.is_container
            assert ("User=hgxserve-engine" in lines) == unprivileged, unit.name
            assert ("Group=hgxserve-engine" in lines) == unprivileged, unit.name
            root = "+" if unprivileged else ""
            check = f"{root}/opt/hgxserve/bin/hgxserve gpus check-free --gpus {gpus}"
            assert f"ExecStartPre={check}" in lines
            wait = f"{root}/opt/hgxserve/bin/hgxserve gpus wait-free --gpus {gpus} --timeout 120"
            assert f"ExecStopPost={wait}" in lines
            key_dir = os.path.dirname(unit.env["VLLM_CACHE_ROOT"])
            run_dir = os.path.dirname(unit.env["TMPDIR"])
            make = [line for line in lines if line.startswith("ExecStartPre=") and key_dir in line]
            assert len(make) == 1, make
            if unprivileged:
                # systemd makes the key and run directories for the engine user, the user what
                # is inside them (tests/render/test_engine_privilege.py)
                assert f"CacheDirectory={key_dir.removeprefix('/var/cache/')}" in lines
                assert f"StateDirectory={run_dir.removeprefix('/var/lib/')}" in lines
                assert make[0].startswith("ExecStartPre=/usr/bin/mkdir -p "), make
                assert "ProtectSystem=strict" in lines
                # nothing else of the unit runs as root but the lines that say why (template)
                privileged = [line for line in lines if re.match(r"^Exec\w+=\+", line)]
                assert all(
                    ("gpus " in line or "--api-key-credential" in line) for line in privileged
                )
            else:
                assert make[0].startswith("ExecStartPre=/usr/bin/mkdir -p "), make
                assert "ProtectSystem=full" in lines
            assert f"ReadOnlyPaths=-{topo.model.path}" in lines
            for var in ("VLLM_CACHE_ROOT", "TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR",
                        "DG_JIT_CACHE_DIR", "FLASHINFER_WORKSPACE_BASE", "TILELANG_CACHE_DIR",
                        "CUDA_CACHE_PATH"):  # fmt: skip
                assert unit.env[var].startswith("/var/cache/hgxserve/"), var
            assert unit.env["TMPDIR"].startswith("/var/lib/hgxserve/run/")
            assert unit.env["HF_HUB_OFFLINE"] == "1"
            # nothing written to $HOME or /tmp
            assert not any(v.startswith(("/tmp", "/root", "~")) for v in unit.env.values())
            engine = topo.engines[unit.engine]
            if engine.engine == "sglang":
                assert unit.env["SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION"] == "0"
                assert "--max-running-requests" in unit.argv
            else:
                assert unit.env["VLLM_RPC_BASE_PATH"].startswith("/var/lib/hgxserve/run/")
                assert "--max-num-seqs" in unit.argv


SECRETS = {
    "HGX_TEST_HF_TOKEN": "hf_s3cr3t-value-4242-do-not-leak",
    "HGX_TEST_PROXY_KEY": "sk-proxy-9f8e7d6c5b4a-do-not-leak",
}


def test_secret_values_appear_in_no_rendered_file(monkeypatch):
    for name, value in SECRETS.items():
        monkeypatch.setenv(name, value)
    topo = topology("seed000-2p1d-multinode.yml")
    rendered = render_topology(topo)
    blobs = []
    for host in rendered.values():
        blobs += [f.content for f in host.files.values()]
        for unit in host.units:
            blobs += [*unit.argv, *unit.env.values(), unit.content]
    text = "\n".join(blobs)
    for value in SECRETS.values():
        assert value not in text
    # the units load them as credentials instead, and the wrapper exports them
    decode = rendered["h200-c"].files["/etc/systemd/system/hgxserve-decode-0.service"].content
    assert "LoadCredential=hgx-test-hf-token:/etc/hgxserve/credentials/hgx-test-hf-token" in decode
    assert "exec-with-credentials HF_TOKEN=hgx-test-hf-token -- /opt/vllm-0.26/bin/vllm" in decode
    proxy = rendered["h200-c"].files["/etc/systemd/system/hgxserve-proxy.service"].content
    assert "LoadCredential=api-key:/etc/hgxserve/credentials/api-key" in proxy
    creds = {c.name: c for c in rendered["h200-c"].credentials}
    assert creds["api-key"].path == "/etc/hgxserve/credentials/api-key"
    assert creds["api-key"].ref.value == "HGX_TEST_PROXY_KEY"
    assert creds["hgx-test-hf-token"].units == ("hgxserve-decode-0.service",)
    config = json.loads(rendered["h200-c"].files["/etc/hgxserve/proxy.json"].content)
    assert config["auth"] == {"api_key_file": "/run/credentials/hgxserve-proxy.service/api-key"}


def test_proxy_json_loads_with_the_proxy_loader(tmp_path):
    for path in ALL_TOPOLOGIES:
        topo = load_topology(path)
        if topo.proxy is None or topo.proxy.kind != "hgxserve":
            continue
        files = render_host(topo, topo.proxy.host).files
        target = tmp_path / f"{path.stem}.json"
        target.write_text(files["/etc/hgxserve/proxy.json"].content)
        config = load_proxy_config(target)
        assert config.served_model_name == topo.model.served_name
        assert config.port == topo.proxy.listen_port
        assert len(config.pd_groups) == len(topo.proxy.routes)
        assert len(config.combined) == len(topo.proxy.combined)


def test_proxy_urls_cross_host_and_loopback():
    topo = topology("seed000-2p1d-multinode.yml")
    config = json.loads(render_host(topo, "h200-c").files["/etc/hgxserve/proxy.json"].content)
    group = config["pd_groups"][0]
    assert [e["url"] for e in group["prefill"]] == ["http://10.0.1.11:8100"]  # another host
    assert [e["url"] for e in group["decode"]] == ["http://127.0.0.1:8200"]  # the proxy's host
    # KV events: one publisher and replay per DP rank (8), each on the host running the rank
    events = group["prefill"][0]["kv_events"]
    assert events["publishers"] == [
        *(f"tcp://10.0.1.11:{28100 + r}" for r in range(4)),
        *(f"tcp://10.0.1.12:{28100 + r}" for r in range(4, 8)),
    ]
    assert events["replays"] == [p.replace(":281", ":291") for p in events["publishers"]]
    assert group["decode"][0]["kv_events"]["publishers"][0] == "tcp://127.0.0.1:28200"


def test_container_runtime_podman_cdi_and_env_by_name():
    topo = topology("sglang-pd-image.yml")
    prefill = render_host(topo, "h20-a").units[0]
    argv = prefill.argv
    # --pull=never: the runtime stage loaded the image; a switch never pulls
    assert argv[:6] == [
        "/usr/bin/podman", "run", "--pull=never", "--rm", "--name", "hgxserve-prefill-0"
    ]  # fmt: skip
    pairs = flag_pairs(argv)
    gpus = [f"nvidia.com/gpu={i}" for i in range(8)]
    # the GPUs by CDI, then the HCAs: the KV crosses hosts over Mooncake (RDMA)
    assert [v for f, v in pairs if f == "--device"] == [*gpus, "/dev/infiniband"]
    assert ("--cap-add", "IPC_LOCK") in pairs
    assert ("--network", "host") in pairs and ("--ipc", "host") in pairs
    assert ("--ulimit", "memlock=-1:-1") in pairs
    assert ("--volume", "/models/DeepSeek-V4-Flash-0731:/models/DeepSeek-V4-Flash-0731:ro") in pairs
    envs = [v for f, v in pairs if f == "--env"]
    assert "HF_TOKEN" in envs and all("=" not in e for e in envs)
    digest = "3c5c53248febaa72823a4b7e51aafa1cd2b65d860392e3930414da4d3864f541"
    image = f"registry.example.internal/sglang@sha256:{digest}"
    i = argv.index(image)
    assert argv[i - 2 : i + 2] == ["--entrypoint", "sglang", image, "serve"]
    # in a container the CDI devices are the only GPUs: no host indices inside
    assert "CUDA_VISIBLE_DEVICES" not in prefill.env
    assert "ExecStop=/usr/bin/podman stop --time 60 hgxserve-prefill-0" in prefill.content
    assert "ExecStartPre=-/usr/bin/podman rm --force --ignore hgxserve-prefill-0" in prefill.content
    flags = dict(flag_pairs(argv[i + 2 :]))
    assert flags["--disaggregation-mode"] == "prefill"
    assert flags["--disaggregation-transfer-backend"] == "mooncake"
    assert flags["--disaggregation-bootstrap-port"] == "8998"
    assert flags["--disaggregation-ib-device"] == "mlx5_0,mlx5_1"
    assert flags["--kv-cache-dtype"] == "fp8_e4m3"
    assert flags["--page-size"] == "64"
    assert "--disable-radix-cache" in flags
    decode = render_host(topo, "h20-b").units[0]
    dflags = dict(flag_pairs(decode.argv))
    assert dflags["--disaggregation-mode"] == "decode"
    assert "--disaggregation-bootstrap-port" not in dflags


def test_docker_runtime_and_vllm_router():
    topo = topology("vllm-dp-two-nodes-docker.yml")
    host = render_host(topo, "h200-a")
    engine, watch, proxy = host.units
    assert watch.role == "watch"
    assert engine.argv[0] == "/usr/bin/docker"
    assert "ExecStop=/usr/bin/docker stop --time 60 hgxserve-combined-0" in engine.content
    assert "ExecStopPost=-/usr/bin/docker rm --force hgxserve-combined-0" in engine.content
    spec = dict(flag_pairs(engine.argv[engine.argv.index("serve") :]))
    assert spec["--speculative-config"] == '{"method":"mtp","num_speculative_tokens":1}'
    assert spec["--data-parallel-size-local"] == "2"
    assert proxy.argv[:3] == ["/opt/hgxserve/bin/vllm-router", "--policy", "consistent_hash"]
    assert proxy.argv[proxy.argv.index("--worker-urls") + 1] == "http://127.0.0.1:8100"
    assert "/etc/hgxserve/proxy.json" not in host.files


def test_sglang_router_pd_command():
    topo = topology("sglang-pd-image.yml")
    proxy = render_host(topo, "h20-a").units[-1]
    argv = proxy.argv
    assert argv[:3] == ["/opt/hgxserve/bin/python", "-m", "sglang_router.launch_router"]
    assert "--pd-disaggregation" in argv
    i = argv.index("--prefill")
    # the router hands the decode on h20-b this URL's host as bootstrap_host: not loopback
    assert argv[i + 1 : i + 3] == ["http://10.0.0.11:30000", "8998"]
    assert argv[argv.index("--decode") + 1] == "http://10.0.0.12:30001"


def test_router_with_api_key_is_refused():
    topo = topology("seed000-2p1d-multinode.yml")
    assert topo.proxy is not None
    routed = replace(topo, proxy=replace(topo.proxy, kind="vllm-router"))
    with pytest.raises(RenderError, match="API keys only on the command line"):
        render_host(routed, "h200-c")


def test_unknown_host_is_a_clear_error():
    with pytest.raises(RenderError, match="not in topology"):
        render_host(topology("h20-v4flash-tp8.yml"), "nope")


def test_tree_digest_is_deterministic_and_content_sensitive():
    a = render_host(topology("h20-v4flash-4p4d.yml"), "h20-a")
    b = render_host(topology("h20-v4flash-4p4d.yml"), "h20-a")
    assert a.digest == b.digest == tree_digest(a.tree)
    assert re.fullmatch(r"[0-9a-f]{64}", a.digest)
    files = dict(a.files)
    path = "/etc/hgxserve/proxy.json"
    changed = HostRender("h20-a", a.units, {**files, path: RenderedFile(files[path].content + " ")})
    assert changed.digest != a.digest
    mode = HostRender("h20-a", a.units, {**files, path: RenderedFile(files[path].content, 0o600)})
    assert mode.digest != a.digest
    moved = {("/x" + p if p == path else p): f for p, f in files.items()}
    assert HostRender("h20-a", a.units, moved).digest != a.digest


def test_rendered_digest_is_the_release_tree_digest_the_host_computes(tmp_path):
    """`hgxserve render` prints HostRender.digest; the release records it and the host's store
    computes the same over the files staged under releases/<id>/tree."""
    from hgxserve.release.plan import plan_release
    from hgxserve.release.store import ReleaseError, Store

    topo = topology("h20-v4flash-4p4d.yml")
    rendered = render_host(topo, "h20-a")
    plan = plan_release(topo, "h20-a")
    assert plan.spec.tree_digest == rendered.digest
    store = Store(str(tmp_path))
    staged = store.release_dir(plan.spec.id) / "tree"
    for path, (content, _mode) in plan.files.items():
        (staged / path.lstrip("/")).parent.mkdir(parents=True, exist_ok=True)
        (staged / path.lstrip("/")).write_text(content)
    assert store.tree_digest(plan.spec) == rendered.digest
    store.verify_tree(plan.spec)
    (staged / "etc/hgxserve/proxy.json").write_text("{}")
    with pytest.raises(ReleaseError, match="do not match the rendered tree"):
        store.verify_tree(plan.spec)


def _systemd_split(line: str) -> list[str]:
    """Enough of systemd's word splitting (quotes, C escapes, %% and $$) to check our quoting."""
    words, i = [], 0
    while i < len(line):
        if line[i] == " ":
            i += 1
            continue
        word = ""
        if line[i] == '"':
            i += 1
            while line[i] != '"':
                if line[i] == "\\":
                    word += {"n": "\n", "t": "\t"}.get(line[i + 1], line[i + 1])
                    i += 2
                else:
                    word += line[i]
                    i += 1
            i += 1
        else:
            while i < len(line) and line[i] != " ":
                word += line[i]
                i += 1
        words.append(word.replace("%%", "%").replace("$$", "$"))
    return words


@pytest.mark.parametrize(
    "word",
    ['{"a":"b c"}', "100%", "$HOME", "a\\b", "tab\there", "", ";", "it's", "x=1,2"],
)
def test_systemd_quoting_round_trips(word):
    line = exec_line(["/bin/x", word, "tail"])
    assert _systemd_split(line) == ["/bin/x", word, "tail"]
    assert "$" not in quote_word(word).replace("$$", "")
