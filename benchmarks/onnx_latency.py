"""onnxruntime (CPU) on the project's ONNX export vs Keras ``predict`` on every installed backend.

    python benchmarks/onnx_latency.py [--batch 1] [--length 512] [--width 256] [--heads 8]
        [--layers 2] [--repeats 10] [--threads N] [--cases layer,stack]
        [--modes prefill,decode] [--dtypes float32,float16] [--backends jax,torch,tensorflow]
        [--decode-position P] [--ort-plain] [--pause MS] [--json out.json]

Cases: "layer" (one causal DCMHA self-attention, all compositions on, RoPE) and
"stack" (--layers pre-norm blocks: RMSNorm, DCMHA, residual, RMSNorm, gelu MLP,
residual). Modes: "prefill" (the forward of --length tokens: Keras
``model.predict_on_batch``, compiled on jax / tensorflow, eager on torch;
onnxruntime the forward graph) and "decode" (one cached token at position
--decode-position, default --length - 1, with a cache of --length positions:
Keras calls the DCMHA layers with ``cache=`` in one ``jax.jit`` / ``tf.function``
step, eager under ``torch.no_grad()``; onnxruntime runs the decode graph,
``to_onnx(..., decode=True)``). The graphs are exported as users get them:
each compose a ``dcmha.Compose*`` node, which ``dcmha.export.session`` runs as the
compiled compose kernel (``dcmha.export.ort_ops``). ``--ort-plain`` adds a second
onnxruntime worker on the graphs exported with ``compose_nodes=False`` (every
compose as plain ops) in a bare ``onnxruntime.InferenceSession`` with onnxruntime's
default options (what a deployment without dcmha installed runs), column "ort plain",
which "fastest/ort" leaves out; "plain/fastest" is its median over the fastest Keras
backend's (below 1: the plain session is faster). Dtypes: the Keras models are built in that
dtype, the ONNX graph is exported in it (float16 graphs keep scores, compose and
softmax in float32, as the layer does).

Keras fixes its backend at import, and runtimes that share a process fight over
the cores (their idle worker threads spin), so every runtime runs in its own
worker process: one per Keras backend and one for onnxruntime (which imports no
framework). The first backend builds the models with a fixed seed, saves the
weights (the others load them) and exports the graphs. For each case, mode and
dtype every worker warms up, then the controller asks the workers in turn for
one timed call each, rotating the order, ``--repeats`` rounds: the runtimes are
timed alternately under the same machine load. Reported: the median and the
interquartile range of each, the max relative difference of each Keras output
from onnxruntime's, and fastest Keras / onnxruntime (above 1: onnxruntime is
faster). The load average is printed with the figures: on a shared machine the
ratios are the meaningful part.

``--pause MS`` sleeps after every timed call, so that each call starts on an idle
machine, as a request after a gap would, instead of back to back with the other
runtimes' calls. The ratios depend on it (benchmarks/RESULTS.md): after a pause the
runtimes wake their sleeping worker threads, and pay for that differently.

``main(argv)`` returns the result dict (also written by --json).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

BACKENDS = ("jax", "torch", "tensorflow")
ORT = "onnxruntime"
ORT_PLAIN = "ort plain"


# ---------------------------------------------------------------------------
# Models (built in the Keras workers)
# ---------------------------------------------------------------------------

def build_models(width: int, heads: int, layers: int, dtype=None):
    """{"layer": model, "stack": model}: functional Keras models of the two cases."""
    import keras
    from dcmha.layers import DCMHA

    key_dim = width // heads

    def attention(name):
        return DCMHA(heads, key_dim, rope_max_wavelength=10000.0, name=name, dtype=dtype)

    x = keras.Input((None, width), name="x")
    single = keras.Model(x, attention("attention")(x, x, use_causal_mask=True), name="layer")
    h = x
    for i in range(layers):
        a = keras.layers.RMSNormalization(name=f"attention_norm_{i}", dtype=dtype)(h)
        h = keras.layers.Add(name=f"attention_residual_{i}", dtype=dtype)(
            [h, attention(f"attention_{i}")(a, a, use_causal_mask=True)])
        f = keras.layers.RMSNormalization(name=f"ffn_norm_{i}", dtype=dtype)(h)
        f = keras.layers.Dense(4 * width, activation="gelu", name=f"up_{i}", dtype=dtype)(f)
        h = keras.layers.Add(name=f"ffn_residual_{i}", dtype=dtype)(
            [h, keras.layers.Dense(width, name=f"down_{i}", dtype=dtype)(f)])
    stack = keras.Model(x, h, name="stack")
    return {"layer": single, "stack": stack}


def decode_step(model, case: str, layers: int):
    """step(x (B, 1, D), caches [one dict per DCMHA layer], index) -> (y, caches): the
    model's computation on new tokens, its DCMHA layers reading and writing ``caches``."""
    if case == "layer":
        attention = model.get_layer("attention")

        def step(x, caches, index):
            y, cache = attention(x, x, use_causal_mask=True, cache=caches[0],
                                 cache_update_index=index)
            return y, [cache]
        return step

    get = model.get_layer

    def step(x, caches, index):
        out = []
        h = x
        for i in range(layers):
            a = get(f"attention_norm_{i}")(h)
            a, cache = get(f"attention_{i}")(a, a, use_causal_mask=True, cache=caches[i],
                                             cache_update_index=index)
            out.append(cache)
            h = h + a
            h = h + get(f"down_{i}")(get(f"up_{i}")(get(f"ffn_norm_{i}")(h)))
        return h, out
    return step


def compiled(step, backend: str):
    """``step`` compiled the backend's way: jax.jit, tf.function, eager torch (no_grad)."""
    if backend == "jax":
        import jax
        return jax.jit(step)
    if backend == "tensorflow":
        import tensorflow as tf
        return tf.function(step, autograph=False, reduce_retracing=True)
    import torch

    def eager(*args):
        with torch.no_grad():
            return step(*args)
    return eager


# ---------------------------------------------------------------------------
# Workers: one process per runtime, JSON commands on stdin, one JSON reply per line
# ---------------------------------------------------------------------------

class KerasWorker:
    def __init__(self, args, tmp):
        import keras
        self.keras, self.args, self.tmp = keras, args, tmp
        self.backend = keras.backend.backend()
        self.models = {}
        self.run = None

    def model(self, case, dtype):
        if (case, dtype) not in self.models:
            a = self.args
            self.keras.utils.set_random_seed(0)
            m = build_models(a.width, a.heads, a.layers, dtype=dtype)[case]
            weights = os.path.join(self.tmp, f"{case}.weights.h5")
            if os.path.exists(weights):
                m.load_weights(weights)
            self.models[case, dtype] = m
        return self.models[case, dtype]

    def export(self, cases, dtypes, modes):
        """Save the float32 weights of each case and write its graphs (first worker only)."""
        from dcmha.export import to_onnx

        for case in cases:
            m = self.model(case, "float32")
            m.save_weights(os.path.join(self.tmp, f"{case}.weights.h5"))
            for dtype in dtypes:
                for mode in modes:
                    for plain in ((False, True) if self.args.ort_plain else (False,)):
                        to_onnx(m, graph_path(self.tmp, case, mode, dtype, plain), dtype=dtype,
                                decode=mode == "decode", compose_nodes=not plain)
        return {}

    def prepare(self, case, mode, dtype, inputs):
        keras, ops = self.keras, self.keras.ops
        m = self.model(case, dtype)
        feeds = dict(np.load(inputs))
        x = feeds["x"].astype(dtype)
        if mode == "prefill":
            def run():
                return ops.convert_to_numpy(m.predict_on_batch(x))
        else:
            step = compiled(decode_step(m, case, self.args.layers), self.backend)
            n_layers = 1 if case == "layer" else self.args.layers
            caches = [{k[len(f"cache{i}/"):]: ops.convert_to_tensor(v.astype(dtype))
                       for k, v in feeds.items() if k.startswith(f"cache{i}/")}
                      for i in range(n_layers)]
            xt = ops.convert_to_tensor(x)
            position = int(feeds["index"])
            index = position if self.backend == "torch" else ops.convert_to_tensor(position, "int32")

            def run():
                return ops.convert_to_numpy(step(xt, caches, index)[0])
        self.run = run
        for _ in range(2):
            out = run()
        path = os.path.join(self.tmp, f"out_{self.backend}.npy")
        np.save(path, np.asarray(out, np.float32))
        return {"output": path}


class OrtWorker:
    def __init__(self, args, tmp, plain=False):
        self.args, self.tmp, self.plain = args, tmp, plain
        self.backend = ORT_PLAIN if plain else ORT
        self.run = None

    def prepare(self, case, mode, dtype, inputs):
        from dcmha.export import core
        from dcmha.export.verification import read_export_metadata

        path = graph_path(self.tmp, case, mode, dtype, self.plain)
        if self.plain:   # what a deployment without dcmha installed runs: onnxruntime's defaults
            import onnxruntime as ort
            so = ort.SessionOptions()
            if self.args.threads:
                so.intra_op_num_threads = self.args.threads
            sess = ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])
        else:
            sess = core.session(path, threads=self.args.threads)
        np_dtype = core.NP_DTYPES[dtype]
        feeds = dict(np.load(inputs))
        feed = {sess.get_inputs()[0].name: feeds["x"].astype(np_dtype)}
        if mode == "decode":
            meta = read_export_metadata(path)
            feed[meta["cache_index"]] = np.array(int(feeds["index"]), np.int64)
            for i, entry in enumerate(meta["caches"]):
                for n, past in entry["past"].items():
                    feed[past] = feeds[f"cache{i}/{n}"].astype(np_dtype)
        first = sess.get_outputs()[0].name

        def run():
            return sess.run([first], feed)[0]
        self.run = run
        for _ in range(2):
            out = run()
        p = os.path.join(self.tmp, f"out_{'ort_plain' if self.plain else 'onnxruntime'}.npy")
        np.save(p, np.asarray(out, np.float32))
        return {"output": p}


def graph_path(tmp, case, mode, dtype, plain=False):
    return os.path.join(tmp, f"{case}_{mode}_{dtype}{'_plain' if plain else ''}.onnx")


def worker_main(backend: str, argv) -> int:
    # replies go to the original stdout; anything a library prints goes to stderr
    reply = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    args = parse(argv)
    tmp = args.tmp
    try:
        w = (OrtWorker(args, tmp, plain=backend == ORT_PLAIN) if backend in (ORT, ORT_PLAIN)
             else KerasWorker(args, tmp))
        reply.write(json.dumps({"ready": w.backend}) + "\n")
    except Exception as err:  # noqa: BLE001 - reported to the controller
        reply.write(json.dumps({"error": f"{type(err).__name__}: {err}"}) + "\n")
        return 1
    for line in sys.stdin:
        cmd = json.loads(line)
        try:
            if cmd["op"] == "time":
                t0 = time.perf_counter()
                w.run()
                res = {"seconds": time.perf_counter() - t0}
            elif cmd["op"] == "prepare":
                res = w.prepare(cmd["case"], cmd["mode"], cmd["dtype"], cmd["inputs"])
            elif cmd["op"] == "export":
                res = w.export(cmd["cases"], cmd["dtypes"], cmd["modes"])
            else:
                return 0
        except Exception as err:  # noqa: BLE001 - reported to the controller
            res = {"error": f"{type(err).__name__}: {str(err)[:500]}"}
        reply.write(json.dumps(res) + "\n")
    return 0


class Proc:
    def __init__(self, backend, argv):
        env = dict(os.environ)
        # the onnxruntime worker imports no framework; Keras gets the light numpy backend
        env["KERAS_BACKEND"] = "numpy" if backend in (ORT, ORT_PLAIN) else backend
        self.backend = backend
        self.p = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--worker", backend]
                                  + list(argv), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  stderr=subprocess.DEVNULL, text=True, env=env)
        self.error = self.read().get("error")

    def read(self):
        line = self.p.stdout.readline()
        return json.loads(line) if line else {"error": "worker exited"}

    def ask(self, **cmd):
        self.p.stdin.write(json.dumps(cmd) + "\n")
        self.p.stdin.flush()
        return self.read()

    def close(self):
        try:
            self.p.stdin.close()
        except OSError:
            pass
        self.p.wait(timeout=60)


# ---------------------------------------------------------------------------
# Controller
# ---------------------------------------------------------------------------

def parse(argv):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--length", type=int, default=512, help="prefill length and cache length")
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--layers", type=int, default=2, help="blocks in the stack case")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--threads", type=int, default=None, help="onnxruntime intra-op threads")
    ap.add_argument("--cases", default="layer,stack")
    ap.add_argument("--modes", default="prefill,decode")
    ap.add_argument("--dtypes", default="float32,float16")
    ap.add_argument("--backends", default=",".join(BACKENDS),
                    help="Keras backends to compare (those not installed are skipped)")
    ap.add_argument("--decode-position", type=int, default=None,
                    help="position of the decoded token (default: --length - 1)")
    ap.add_argument("--ort-plain", action="store_true",
                    help="also time onnxruntime on the graphs without Compose nodes")
    ap.add_argument("--pause", type=float, default=0.0,
                    help="milliseconds of sleep after every timed call: each call then "
                         "starts on an idle machine (default 0: calls back to back)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--tmp", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    for name in ("batch", "length", "width", "heads", "layers", "repeats"):
        if getattr(args, name) <= 0:
            ap.error(f"--{name} must be a positive integer")
    pos = args.decode_position
    if pos is not None and not 0 <= pos < args.length:
        ap.error(f"--decode-position must be in [0, --length). Received: {pos}")
    return args


def _without_json(argv):
    """argv less --json and its value (the workers write no file)."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == "--json":
            skip = True
        elif not a.startswith("--json="):
            out.append(a)
    return out


def _split(s):
    return [c.strip() for c in s.split(",") if c.strip()]


def _installed(backend):
    import importlib.util
    return importlib.util.find_spec(backend) is not None


def _inputs(args, tmp, case, mode):
    """The shared inputs of one case and mode (npz): x, and for decode index and caches."""
    from dcmha.spec import reference as ref

    rng = np.random.default_rng(0)
    B, L, D = args.batch, args.length, args.width
    feeds = {"x": rng.normal(size=(B, L if mode == "prefill" else 1, D)).astype(np.float32)}
    if mode == "decode":
        feeds["index"] = np.array(L - 1 if args.decode_position is None else args.decode_position)
        cfg = ref.Config(num_heads=args.heads, key_dim=D // args.heads,
                         rope_max_wavelength=10000.0)
        for i in range(1 if case == "layer" else args.layers):
            for n, shape in ref.cache_shapes(cfg, B, L).items():
                feeds[f"cache{i}/{n}"] = rng.normal(size=shape).astype(np.float32)
    path = os.path.join(tmp, f"inputs_{case}_{mode}.npz")
    np.savez(path, **feeds)
    return path


def _stats(ts):
    q1, med, q3 = np.percentile(np.asarray(ts) * 1e3, [25, 50, 75])
    return {"ms": float(med), "iqr_ms": [float(q1), float(q3)], "min_ms": float(1e3 * min(ts))}


def main(argv=None) -> dict:
    args = parse(argv)
    if args.worker:
        sys.exit(worker_main(args.worker, argv))
    cases, modes, dtypes = _split(args.cases), _split(args.modes), _split(args.dtypes)
    backends = [b for b in _split(args.backends) if _installed(b)]
    import onnxruntime

    load0 = os.getloadavg()
    result = {"config": {k: getattr(args, k) for k in ("batch", "length", "width", "heads",
                                                       "layers", "repeats", "threads")},
              "decode_position": args.length - 1 if args.decode_position is None
              else args.decode_position,
              "onnxruntime": onnxruntime.__version__, "load_before": list(load0),
              "errors": {}, "rows": []}
    with tempfile.TemporaryDirectory() as tmp:
        fwd = _without_json(argv if argv is not None else sys.argv[1:]) + ["--tmp", tmp]
        procs = []
        for b in backends:          # one at a time: the first exports for the others
            p = Proc(b, fwd)
            if p.error:
                result["errors"][b] = p.error
                p.close()
                continue
            if not procs:
                res = p.ask(op="export", cases=cases, dtypes=dtypes, modes=modes)
                if "error" in res:
                    raise RuntimeError(f"export on {b} failed: {res['error']}")
            procs.append(p)
        if not procs:
            raise RuntimeError(f"No Keras backend could start: {result['errors']}")
        ort = Proc(ORT, fwd)
        if ort.error:
            raise RuntimeError(f"onnxruntime worker failed: {ort.error}")
        workers = [ort] + procs
        if args.ort_plain:
            plain = Proc(ORT_PLAIN, fwd)
            if plain.error:
                raise RuntimeError(f"onnxruntime worker failed: {plain.error}")
            workers.append(plain)
        try:
            for case in cases:
                for mode in modes:
                    inputs = _inputs(args, tmp, case, mode)
                    for dtype in dtypes:
                        result["rows"].append(_measure(args, workers, case, mode, dtype, inputs,
                                                       result["errors"]))
        finally:
            for p in workers:
                p.close()
    result["load_after"] = list(os.getloadavg())
    _print(result, backends + ([ORT_PLAIN] if args.ort_plain else []))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return result


def _measure(args, workers, case, mode, dtype, inputs, errors):
    row = {"case": case, "mode": mode, "dtype": dtype}
    live, outs = [], {}
    for w in workers:
        res = w.ask(op="prepare", case=case, mode=mode, dtype=dtype, inputs=inputs)
        if "error" in res:
            errors[f"{w.backend}/{case}/{mode}/{dtype}"] = res["error"]
            continue
        live.append(w)
        outs[w.backend] = np.load(res["output"]).astype(np.float64)
    times = {w.backend: [] for w in live}
    for r in range(args.repeats):      # rotate the order: no runtime always goes first
        for w in live[r % len(live):] + live[:r % len(live)]:
            times[w.backend].append(w.ask(op="time")["seconds"])
            if args.pause:
                time.sleep(args.pause / 1e3)
    stats = {b: _stats(t) for b, t in times.items()}
    if ORT in stats:
        row[ORT] = stats.pop(ORT)
    if ORT_PLAIN in stats:
        row[ORT_PLAIN] = stats.pop(ORT_PLAIN)
    row["keras"] = stats
    want = outs.get(ORT)
    for b in stats:
        if want is not None and outs[b].shape == want.shape:
            stats[b]["max_rel_diff"] = float(np.max(np.abs(outs[b] - want)) / np.max(np.abs(want)))
    if stats and ORT in row:
        fastest = min(stats, key=lambda b: stats[b]["ms"])
        row["fastest_keras"] = fastest
        row["fastest_keras_over_ort"] = stats[fastest]["ms"] / row[ORT]["ms"]
    if stats and ORT_PLAIN in row:   # the plain session's time as a share of Keras's
        fastest = min(stats, key=lambda b: stats[b]["ms"])
        row["ort_plain_over_fastest_keras"] = row[ORT_PLAIN]["ms"] / stats[fastest]["ms"]
    return row


def _print(result, backends):
    c = result["config"]
    print(f"onnxruntime {result['onnxruntime']} CPU (threads {c['threads'] or 'default'}) vs Keras "
          f"predict; B={c['batch']} T={c['length']} D={c['width']} N={c['heads']}, stack of "
          f"{c['layers']}; decode: one token at position {result['decode_position']}, cache "
          f"{c['length']}; median [IQR] ms of {c['repeats']} alternating calls; load "
          f"{result['load_before'][0]:.2f} -> {result['load_after'][0]:.2f}")
    head = f"{'case':<6} {'mode':<8} {'dtype':<8} {'onnxruntime':>22}"
    for b in backends:
        head += f" {b:>22}"
    plain = ORT_PLAIN in backends
    print(head + f" {'fastest/ort':>12}" + (f" {'plain/fastest':>14}" if plain else ""))

    def cell(s):
        return f"{s['ms']:.2f} [{s['iqr_ms'][0]:.2f}-{s['iqr_ms'][1]:.2f}]" if s else "-"
    for row in result["rows"]:
        line = f"{row['case']:<6} {row['mode']:<8} {row['dtype']:<8} {cell(row.get(ORT)):>22}"
        for b in backends:
            line += f" {cell(row.get(b) if b == ORT_PLAIN else row['keras'].get(b)):>22}"
        ratio = row.get("fastest_keras_over_ort")
        line += f" {'-' if ratio is None else f'{ratio:.2f}':>12}"
        if plain:
            share = row.get("ort_plain_over_fastest_keras")
            line += f" {'-' if share is None else f'{share:.2f}':>14}"
        print(line)
    diffs = {f"{r['case']}/{r['mode']}/{r['dtype']}/{b}": s.get("max_rel_diff")
             for r in result["rows"] for b, s in r["keras"].items()}
    print("max relative difference of each Keras output from onnxruntime's: " + ", ".join(
        f"{k} {v:.1e}" for k, v in diffs.items() if v is not None))
    for k, v in result["errors"].items():
        print(f"skipped {k}: {v}")


if __name__ == "__main__":
    main()
    sys.exit(0)
