"""The built-in demo lab around the test hosts: a tiny model, a local S3 (moto) on the
controller's bridge address, and the S3 credentials file the demo topologies reference.

Everything here is demo/test scaffolding (simulated GPUs, a model with random weights); the
product code it exercises (weights sync, releases, proxy) is the real one.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import struct
import subprocess
import time
from pathlib import Path

from testbed import hosts as testbed_hosts

REPO = Path(__file__).resolve().parent.parent
BRIDGE_ADDRESS = "10.77.0.1"
S3_PORT = 9000
S3_ENDPOINT = f"http://{BRIDGE_ADDRESS}:{S3_PORT}"
BUCKET, PREFIX = "models", "tiny/"
# moto accepts any key pair; real labs put read-only keys here (seed 003 §3.2)
DEMO_CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "hgxserve-demo",
    "AWS_SECRET_ACCESS_KEY": "hgxserve-demo-secret",
    "AWS_DEFAULT_REGION": "us-east-1",
}
# The demo topologies' proxy.auth keys: systemd credentials in /etc/credstore on every host, as
# a lab would provision them once (the values are test-only; real ones come from a vault)
DEMO_API_KEY = "hgxserve-demo-api-key-0123456789"
DEMO_ENGINE_KEY = "hgxserve-demo-engine-key-9876543210"
CREDSTORE = {"hgxserve-api-key": DEMO_API_KEY, "hgxserve-engine-key": DEMO_ENGINE_KEY}


def api_key_file(directory: Path) -> Path:
    """The demo proxy's client key in a 0600 file, for `hgxserve bench --api-key-file`."""
    path = directory / "demo-api-key"
    path.touch(mode=0o600)
    path.write_text(DEMO_API_KEY + "\n")
    return path


STATE = testbed_hosts.STATE_DIR / "demo-s3.json"
# The demo model's pin, kept outside the bucket as a lab keeps its pins file: inventory/
# testhosts.py names this file as every host's `model_pins`, so the weights stage verifies, and
# the engine units check, the digest published here (docs/weights.md "Trust root").
PINS = testbed_hosts.STATE_DIR / "demo-pins.yml"
# Make a test host look as if it never ran an hgxserve release (tests start from and leave this).
FORGET_RELEASES = (
    "systemctl stop 'hgxserve-*' 2>/dev/null; "
    "rm -f /etc/systemd/system/hgxserve-*; rm -rf /var/lib/hgxserve /etc/hgxserve/proxy.json "
    "/etc/hgxserve/watch /etc/hgxserve/firewall.nft /etc/hgxserve/firewall.d; "
    "nft delete table inet hgxserve 2>/dev/null; "
    "systemctl daemon-reload; systemctl reset-failed"
)


# The simulated engine's chat format (testbed/simengine.py render_chat): `<|role|>\n` + content
# + `\n` per message (a list content: its parts' text joined by one space), then `<|assistant|>\n`
# when add_generation_prompt. A proxy rendering this template with the messages and tokenizing
# with byte_tokenizer_json() gets exactly the token ids the simulated engine caches.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|' + (message['role'] or '') + '|>\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% elif message['content'] is iterable and message['content'] is not mapping %}"
    "{% for part in message['content'] if part is mapping %}"
    "{% if not loop.first %}{{ ' ' }}{% endif %}"
    "{{ part['text'] if part['text'] is defined else '' }}"
    "{% endfor %}{% endif %}"
    "{{ '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet: one printable character per byte value."""
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    chars = list(keep)
    extra = 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(keep, chars, strict=True)}


def byte_tokenizer_json() -> str:
    """tokenizer.json of a byte-level vocabulary whose token id is the byte's value (no merges,
    no special tokens): the ids the simulated engine uses, UTF-8 bytes of the prompt."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {char: byte for byte, char in _bytes_to_unicode().items()}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    return str(tokenizer.to_str(pretty=True))


def make_tiny_model(dest: Path, *, shards: int = 2, shard_mib: int = 2) -> Path:
    """A small Llama-shaped checkpoint: config, a byte-level tokenizer with the simulated
    engine's chat template, and safetensors shards with random weights (real safetensors
    headers), enough for sync/verify, the simulated engine and a proxy that tokenizes."""
    dest.mkdir(parents=True, exist_ok=True)
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 64,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "num_hidden_layers": 2,
        "vocab_size": 512,
        "max_position_embeddings": 256,
        "torch_dtype": "float32",
    }
    (dest / "config.json").write_text(json.dumps(config, indent=2))
    (dest / "generation_config.json").write_text(json.dumps({"do_sample": False}))
    (dest / "tokenizer.json").write_text(byte_tokenizer_json())
    tokenizer_config = {
        "model_max_length": 256,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "chat_template": CHAT_TEMPLATE,
    }
    (dest / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
    weight_map = {}
    for i in range(shards):
        name = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        nbytes = shard_mib << 20
        tensor = f"model.layers.{i}.mlp.weight"
        header = json.dumps(
            {tensor: {"dtype": "F32", "shape": [nbytes // 4], "data_offsets": [0, nbytes]}}
        ).encode()
        header += b" " * (-len(header) % 8)
        with (dest / name).open("wb") as fh:
            fh.write(struct.pack("<Q", len(header)) + header + os.urandom(nbytes))
        weight_map[tensor] = name
    index = {"metadata": {"total_size": shards * (shard_mib << 20)}, "weight_map": weight_map}
    (dest / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return dest


def _port_open(host: str, port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(0.3)
        return sock.connect_ex((host, port)) == 0


def start_s3() -> int:
    """Start moto_server on the bridge address (if not running); return its PID."""
    if STATE.exists():
        pid = json.loads(STATE.read_text())["pid"]
        if Path(f"/proc/{pid}").exists() and _port_open(BRIDGE_ADDRESS, S3_PORT):
            return int(pid)
    log = STATE.with_suffix(".log").open("wb")
    proc = subprocess.Popen(
        [str(REPO / ".venv/bin/moto_server"), "-H", BRIDGE_ADDRESS, "-p", str(S3_PORT)],
        stdout=log,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        start_new_session=True,
    )
    deadline = time.monotonic() + 20
    while not _port_open(BRIDGE_ADDRESS, S3_PORT):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"local S3 did not start; see {log.name}")
        time.sleep(0.2)
    STATE.write_text(json.dumps({"pid": proc.pid}))
    return proc.pid


def stop_s3() -> None:
    if not STATE.exists():
        return
    pid = int(json.loads(STATE.read_text())["pid"])
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    STATE.unlink(missing_ok=True)


def s3_env() -> dict[str, str]:
    return {**os.environ, **DEMO_CREDENTIALS, "AWS_ENDPOINT_URL": S3_ENDPOINT}


def publish_model(model_dir: Path) -> str:
    """Upload the model to the local S3 and publish its manifest; pin its digest in PINS and
    return it."""
    import boto3

    s3 = boto3.client("s3", endpoint_url=S3_ENDPOINT, **_boto_kwargs())
    with contextlib.suppress(s3.exceptions.BucketAlreadyOwnedByYou):
        s3.create_bucket(Bucket=BUCKET)
    for path in sorted(model_dir.rglob("*")):
        if path.is_file():
            s3.upload_file(str(path), BUCKET, PREFIX + str(path.relative_to(model_dir)))
    hgxserve = str(REPO / ".venv/bin/hgxserve")
    proc = subprocess.run(
        [hgxserve, "weights", "manifest", f"s3://{BUCKET}/{PREFIX}", "--publish",
         "--addressing", "path"],
        env=s3_env(), capture_output=True, text=True, check=True,
    )  # fmt: skip
    found = re.search(r"digest (sha256:[0-9a-f]{64})", proc.stderr)
    if found is None:
        raise RuntimeError(f"weights manifest --publish printed no digest: {proc.stderr[-500:]}")
    pins = PINS.with_suffix(".tmp")
    pins.write_text(f"s3://{BUCKET}/{PREFIX.rstrip('/')}: {found[1]}\n")
    pins.replace(PINS)
    return found[1]


def _boto_kwargs() -> dict[str, str]:
    return {
        "aws_access_key_id": DEMO_CREDENTIALS["AWS_ACCESS_KEY_ID"],
        "aws_secret_access_key": DEMO_CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
        "region_name": DEMO_CREDENTIALS["AWS_DEFAULT_REGION"],
    }


def install_credentials(names: list[str]) -> None:
    """Write /etc/hgxserve/s3.env and the proxy's keys in /etc/credstore (0600) on each host,
    as an operator would once per lab."""
    body = "".join(f"{k}={v}\n" for k, v in DEMO_CREDENTIALS.items())
    bed = testbed_hosts.load()
    if bed is None:
        raise RuntimeError("no test hosts are up (python -m testbed up)")
    command = "install -d -m 0755 /etc/hgxserve && umask 077 && cat > /etc/hgxserve/s3.env"
    for name in names:
        subprocess.run(bed.ssh_argv(name, command), input=body, text=True, check=True)
        for cred, value in CREDSTORE.items():
            store = f"install -d -m 0700 /etc/credstore && umask 077 && cat > /etc/credstore/{cred}"
            subprocess.run(bed.ssh_argv(name, store), input=value, text=True, check=True)


def prepare(names: list[str], work: Path) -> None:
    """Tiny model in the local S3 with its manifest, credentials on every host."""
    model = work / "tiny"
    if model.exists():
        shutil.rmtree(model)
    make_tiny_model(model)
    start_s3()
    publish_model(model)
    install_credentials(names)
