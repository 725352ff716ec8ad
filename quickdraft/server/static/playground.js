// The quickdraft playground: streams /v1/completions (SSE over fetch: EventSource cannot POST),
// marks the text of accepted draft tokens, shows the stats live and charts tokens per step.
"use strict";

const $ = (id) => document.getElementById(id);
let model = null;
let controller = null;
let run = null;

function setStatus(text, error = false) {
  $("status").textContent = text;
  $("status").className = error ? "error" : "";
}

async function init() {
  try {
    const models = await (await fetch("/v1/models")).json();
    model = models.data[0].id;
    const health = await (await fetch("/health")).json();
    const k = health.num_speculative_tokens ? `, k=${health.num_speculative_tokens}` : "";
    $("model-info").textContent =
      `${model} · ${health.method}${k} · ${health.engine} engine, ${health.max_batch_size} rows`;
  } catch (err) {
    $("model-info").textContent = "server unreachable";
    setStatus(String(err), true);
  }
}

function newRun() {
  return { steps: [], tokens: 0, drafted: 0, started: performance.now(), firstAt: null, firstTokens: 0,
           finish: null, timings: null };
}

function showStats() {
  const r = run;
  const fmt = (x, digits = 2) => (x === null || x === undefined || Number.isNaN(x) ? "–" : x.toFixed(digits));
  $("stat-tokens").textContent = r.tokens;
  $("stat-steps").textContent = r.steps.length;
  $("stat-mean").textContent = r.steps.length ? fmt(r.tokens / r.steps.length) : "–";
  $("stat-accepted").textContent = r.drafted;
  const t = r.timings;
  $("stat-acceptance").textContent =
    t && t.acceptance_rate !== null ? `${(100 * t.acceptance_rate).toFixed(0)}% (${t.draft_n_accepted}/${t.draft_n})` : "–";
  $("stat-ttft").textContent = r.firstAt === null ? "–" : `${(r.firstAt - r.started).toFixed(0)} ms`;
  const seconds = r.firstAt === null ? 0 : (performance.now() - r.firstAt) / 1000;
  $("stat-rate").textContent = seconds > 0 && r.tokens > r.firstTokens ? fmt((r.tokens - r.firstTokens) / seconds, 1) : "–";
  $("stat-finish").textContent = r.finish || "–";
}

function drawChart() {
  const canvas = $("chart");
  const ctx = canvas.getContext("2d");
  const w = canvas.width, h = canvas.height, pad = 28;
  ctx.clearRect(0, 0, w, h);
  const steps = run ? run.steps : [];
  const top = Math.max(2, ...steps.map((s) => s.tokens));
  ctx.strokeStyle = "#d0d7de";
  ctx.fillStyle = "#57606a";
  ctx.font = "18px system-ui, sans-serif";
  for (let v = 0; v <= top; v++) {  // one grid line per token count
    const y = h - pad - (v / top) * (h - 2 * pad);
    ctx.beginPath(); ctx.moveTo(pad, y); ctx.lineTo(w - 4, y); ctx.stroke();
    ctx.fillText(String(v), 4, y + 6);
  }
  if (!steps.length) return;
  const bar = Math.max(1, (w - pad - 8) / Math.max(steps.length, 24));
  steps.forEach((s, i) => {
    const x = pad + 2 + i * bar;
    const unit = (h - 2 * pad) / top;
    ctx.fillStyle = "#2da44e";
    ctx.fillRect(x, h - pad - s.drafted * unit, Math.max(1, bar - 2), s.drafted * unit);
    ctx.fillStyle = "#8c959f";
    const own = s.tokens - s.drafted;
    ctx.fillRect(x, h - pad - s.tokens * unit, Math.max(1, bar - 2), own * unit);
  });
}

function appendText(segments) {
  const out = $("completion");
  for (const [text, fromDraft] of segments) {
    if (!text) continue;
    if (fromDraft) {
      const span = document.createElement("span");
      span.className = "draft";
      span.textContent = text;
      out.appendChild(span);
    } else {
      out.appendChild(document.createTextNode(text));
    }
  }
}

function handleEvent(data) {
  if (data === "[DONE]") return true;
  const chunk = JSON.parse(data);
  if (chunk.error) throw new Error(chunk.error.message);
  for (const choice of chunk.choices) {
    const step = choice.quickdraft;
    if (step) {
      if (step.tokens && run.firstAt === null) { run.firstAt = performance.now(); run.firstTokens = step.tokens; }
      run.steps.push({ tokens: step.tokens, drafted: step.drafted });
      run.tokens += step.tokens;
      run.drafted += step.drafted;
      appendText(step.segments);
    }
    if (choice.finish_reason) run.finish = choice.finish_reason;
  }
  if (chunk.timings) run.timings = chunk.timings;
  showStats();
  drawChart();
  return false;
}

async function generate() {
  if (!model) await init();
  const prompt = $("prompt").value;
  const body = {
    model, prompt, stream: true, stream_options: { include_usage: true },
    max_tokens: Number($("max-tokens").value) || 16,
    temperature: Number($("temperature").value) || 0,
  };
  if ($("seed").value !== "") body.seed = Number($("seed").value);
  run = newRun();
  $("prompt-echo").textContent = prompt;
  $("completion").textContent = "";
  showStats();
  drawChart();
  controller = new AbortController();
  $("generate").disabled = true;
  $("stop").disabled = false;
  setStatus("waiting for the first token…");
  try {
    const resp = await fetch("/v1/completions", {
      method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify(body),
      signal: controller.signal,
    });
    if (!resp.ok) {
      const err = await resp.json().catch(() => ({ error: { message: resp.statusText } }));
      throw new Error(`${resp.status}: ${err.error.message}`);
    }
    setStatus("streaming…");
    const reader = resp.body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    let done = false;
    while (!done) {
      const { value, done: ended } = await reader.read();
      if (ended) break;
      buffer += decoder.decode(value, { stream: true });
      let end;
      while (!done && (end = buffer.indexOf("\n\n")) >= 0) {
        const event = buffer.slice(0, end);
        buffer = buffer.slice(end + 2);
        if (event.startsWith("data: ")) done = handleEvent(event.slice(6));
      }
    }
    setStatus(`done (${run.finish || "?"})`);
  } catch (err) {
    if (err.name === "AbortError") setStatus("stopped");
    else setStatus(String(err.message || err), true);
  } finally {
    $("generate").disabled = false;
    $("stop").disabled = true;
    showStats();
  }
}

$("generate").addEventListener("click", generate);
$("stop").addEventListener("click", () => controller && controller.abort());
$("prompt").addEventListener("keydown", (e) => {
  if (e.key === "Enter" && (e.ctrlKey || e.metaKey)) generate();
});
init();
drawChart();
