"""A test module run as a script with 8 virtual CPU devices (JAX), for the checks that
need a device mesh: ``worker_environment()`` at the top of the script (before jax is
imported), ``run(path)`` from the test (the worker prints one ``RESULT <json>`` line)."""

import json
import os
import subprocess
import sys

DEVICES = 8


def worker_environment():
    """XLA's virtual CPU devices and the jax backend, for this process."""
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + f" --xla_force_host_platform_device_count={DEVICES}").strip()
    os.environ["KERAS_BACKEND"] = "jax"


def run(path, timeout=600):
    """The JSON result of ``python path`` (asserts it ran and printed one)."""
    env = dict(os.environ, KERAS_BACKEND="jax", PYTHONHASHSEED="0")
    proc = subprocess.run([sys.executable, str(path)], env=env, capture_output=True,
                          text=True, timeout=timeout)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(lines[-1][len("RESULT "):])
