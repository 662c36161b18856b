// One ONNX Runtime attention model on its CPU provider, one intra-op thread: times session.run (best of the
// repeats after one warm-up run) and writes the output's raw values. Called by peers.py:
//   node ort_peer.js MODEL DIR fp32|fp16 SEQ HIDDEN KV_HIDDEN REPEATS OUT GQA
// DIR holds ort-query.bin ([1, SEQ, HIDDEN] raw values of the dtype), ort-key.bin and ort-value.bin ([1, SEQ,
// KV_HIDDEN]); GQA 1 adds
// the GroupQueryAttention inputs for a prompt of SEQ tokens (seqlens_k = SEQ - 1, total_sequence_length = SEQ).
const fs = require("fs");
const path = require("path");
const ort = require("onnxruntime-node");

// VmHWM or VmRSS of this process in KiB (getrusage's peak would start at the parent's, carried across exec).
function statusKib(key) {
  const line = fs.readFileSync("/proc/self/status", "utf8").split("\n").find((l) => l.startsWith(key + ":"));
  return Number(line.split(/\s+/)[1]);
}

async function main() {
  const [model, dir, dtype, seqArg, hiddenArg, kvHiddenArg, repeatsArg, out, gqa] = process.argv.slice(2);
  const seq = Number(seqArg), repeats = Number(repeatsArg);
  const session = await ort.InferenceSession.create(model, {
    intraOpNumThreads: 1,
    interOpNumThreads: 1,
    executionMode: "sequential",
    graphOptimizationLevel: "all",
  });
  const feeds = {};
  for (const name of ["query", "key", "value"]) {
    const bytes = fs.readFileSync(path.join(dir, `ort-${name}.bin`));
    const buf = bytes.buffer.slice(bytes.byteOffset, bytes.byteOffset + bytes.byteLength);
    const data = dtype === "fp16" ? new Uint16Array(buf) : new Float32Array(buf);
    const width = Number(name === "query" ? hiddenArg : kvHiddenArg);
    feeds[name] = new ort.Tensor(dtype === "fp16" ? "float16" : "float32", data, [1, seq, width]);
  }
  const baseKib = statusKib("VmRSS");
  if (gqa === "1") {
    feeds.seqlens_k = new ort.Tensor("int32", Int32Array.from([seq - 1]), [1]);
    feeds.total_sequence_length = new ort.Tensor("int32", Int32Array.from([seq]), []);
  }
  let result = await session.run(feeds);  // warm-up
  let best = Infinity;
  for (let i = 0; i < repeats; ++i) {
    const start = process.hrtime.bigint();
    result = await session.run(feeds);
    best = Math.min(best, Number(process.hrtime.bigint() - start) / 1e9);
  }
  const o = result.output.data;
  fs.writeFileSync(out, Buffer.from(o.buffer, o.byteOffset, o.byteLength));
  // peak resident set beyond what the process held once the inputs were read (KiB -> MiB)
  const peakMib = (statusKib("VmHWM") - baseKib) / 1024;
  console.log(JSON.stringify({ forward: best, peak_mib: peakMib }));
}

main().catch((e) => {
  console.error(String(e && e.message ? e.message : e));
  process.exit(1);
});
