"use strict";
// The kvedge chat page: a client of this server's own OpenAI API (kvedge/serve/ui/__init__.py).
// Model output is untrusted text: it reaches the page through textContent only, never as markup.

const $ = (id) => document.getElementById(id);
const KEY_ITEM = "kvedge.apiKey"; // sessionStorage: this tab only
const SAVE_ITEM = "kvedge.conversation"; // localStorage, only while "keep" is ticked

const chat = {
  model: null, // the served model's id (GET /v1/models)
  personas: [], // warm prefixes given as chat messages: [{name, messages}]
  messages: [], // {role, content, reasoning_content?, tool_calls?, tool_call_id?, stats?, state?}
  controller: null, // the AbortController of the reply in flight
  retry: false, // a reply refused for its key, sent again once a key is given
};

// -- talking to the server ----------------------------------------------------------------

function headers() {
  const result = { "Content-Type": "application/json" };
  const key = sessionStorage.getItem(KEY_ITEM);
  if (key) result.Authorization = `Bearer ${key}`;
  return result;
}

async function errorText(response) {
  try {
    const body = await response.json();
    return `${response.status}: ${body.error.message}`;
  } catch {
    return `${response.status} ${response.statusText}`;
  }
}

// The server-sent events of a streamed completion, parsed; ends at [DONE].
async function* sseEvents(body) {
  const reader = body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += value;
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const block = buffer.slice(0, cut);
      buffer = buffer.slice(cut + 2);
      const data = block
        .split("\n")
        .filter((line) => line.startsWith("data:"))
        .map((line) => line.slice(5).trimStart())
        .join("\n");
      if (data === "[DONE]") return;
      if (data) yield JSON.parse(data);
    }
  }
}

async function loadModels() {
  const response = await fetch("/v1/models", { headers: headers() });
  if (response.status === 401) {
    askKey(sessionStorage.getItem(KEY_ITEM) ? "That key was refused; try again." : null);
    return false;
  }
  if (!response.ok) {
    showError(`cannot list the model: ${await errorText(response)}`);
    return false;
  }
  const card = (await response.json()).data[0];
  chat.model = card.id;
  $("model").textContent = card.id;
  chat.personas = (card.warm_prefixes || []).filter((p) => Array.isArray(p.messages));
  const defaults = card.sampling_defaults;
  if (defaults) $("temperature").placeholder = `${defaults.temperature} (server default)`;
  fillPersonas();
  return true;
}

// -- the request --------------------------------------------------------------------------

function persona() {
  return chat.personas.find((p) => p.name === $("persona").value) || null;
}

function apiMessage(m) {
  const out = { role: m.role, content: m.content };
  if (m.tool_calls && m.tool_calls.length) {
    out.tool_calls = m.tool_calls;
    if (!m.content) out.content = null;
  }
  if (m.tool_call_id) out.tool_call_id = m.tool_call_id;
  return out;
}

// The conversation as sent: system prompt, the persona's other messages, then the chat.
function requestMessages() {
  const out = [];
  const system = $("system").value;
  if (system.trim()) out.push({ role: "system", content: system });
  const chosen = persona();
  if (chosen) out.push(...chosen.messages.filter((m) => m.role !== "system"));
  return out.concat(chat.messages.map(apiMessage));
}

function jsonField(id, what) {
  const text = $(id).value.trim();
  if (!text) return null;
  try {
    return JSON.parse(text);
  } catch (err) {
    throw new Error(`${what} is not valid JSON: ${err.message}`);
  }
}

function requestBody() {
  const body = {
    model: chat.model || "default",
    messages: requestMessages(),
    stream: true,
    stream_options: { include_usage: true },
  };
  const temperature = $("temperature").value;
  if (temperature !== "") body.temperature = Number(temperature);
  const maxTokens = $("max-tokens").value;
  if (maxTokens !== "") body.max_tokens = Number(maxTokens);
  const schema = jsonField("schema", "the reply format");
  if (schema) body.response_format = { type: "json_schema", json_schema: { name: "reply", schema } };
  const tools = jsonField("tools", "the tools list");
  if (tools) Object.assign(body, { tools, tool_choice: $("tool-choice").value });
  return body;
}

// -- a reply ------------------------------------------------------------------------------

function applyDelta(msg, delta) {
  if (delta.content) msg.content += delta.content;
  if (delta.reasoning_content) msg.reasoning_content = (msg.reasoning_content || "") + delta.reasoning_content;
  for (const call of delta.tool_calls || []) {
    msg.tool_calls = msg.tool_calls || [];
    const known = msg.tool_calls[call.index];
    if (known) {
      known.function.arguments += call.function.arguments || "";
    } else {
      msg.tool_calls[call.index] = {
        id: call.id,
        type: "function",
        function: { name: call.function.name, arguments: call.function.arguments || "" },
      };
    }
  }
}

function statsText(timing, usage, finish, state) {
  const parts = [];
  if (timing.first !== null) parts.push(`TTFT ${((timing.first - timing.started) / 1000).toFixed(2)} s`);
  if (usage) {
    const decoding = (timing.ended - (timing.first ?? timing.started)) / 1000;
    if (usage.completion_tokens > 1 && decoding > 0) {
      parts.push(`${((usage.completion_tokens - 1) / decoding).toFixed(1)} tokens/s`);
    }
    parts.push(`${usage.completion_tokens} tokens`);
    const cached = usage.prompt_tokens_details?.cached_tokens ?? 0;
    parts.push(`${cached} of ${usage.prompt_tokens} prompt tokens from the cache`);
  }
  if (state === "stopped") parts.push("stopped");
  else if (finish && finish !== "stop") parts.push(`finish: ${finish}`);
  return parts.join(" · ");
}

// Stream one assistant reply to the conversation as it stands.
async function reply() {
  let body;
  try {
    body = requestBody();
  } catch (err) {
    showError(err.message);
    return;
  }
  showError(null);
  const msg = { role: "assistant", content: "", state: "streaming" };
  chat.messages.push(msg);
  render();
  const timing = { started: performance.now(), first: null, ended: null };
  let usage = null;
  let finish = null;
  chat.controller = new AbortController();
  setBusy(true);
  try {
    const response = await fetch("/v1/chat/completions", {
      method: "POST",
      headers: headers(),
      body: JSON.stringify(body),
      signal: chat.controller.signal,
    });
    if (response.status === 401) {
      chat.messages.pop();
      chat.retry = true;
      askKey(sessionStorage.getItem(KEY_ITEM) ? "That key was refused; try again." : null);
      return;
    }
    if (!response.ok) throw new Error(await errorText(response));
    for await (const event of sseEvents(response.body)) {
      if (event.error) throw new Error(event.error.message);
      if (event.usage) usage = event.usage;
      for (const choice of event.choices || []) {
        const delta = choice.delta || {};
        if (timing.first === null && (delta.content || delta.reasoning_content || delta.tool_calls)) {
          timing.first = performance.now();
        }
        applyDelta(msg, delta);
        if (choice.finish_reason) finish = choice.finish_reason;
      }
      // the reply is the last view, even if a settings change drew the log anew meanwhile
      fillMessage($("log").lastElementChild, msg, chat.messages.length - 1);
    }
    msg.state = "done";
  } catch (err) {
    msg.state = err.name === "AbortError" ? "stopped" : "error";
    if (msg.state === "error") showError(err.message);
  } finally {
    timing.ended = performance.now();
    chat.controller = null;
    const at = chat.messages.indexOf(msg); // -1 after New chat
    if (at >= 0 && msg.state === "error" && !msg.content && !msg.tool_calls) {
      chat.messages.splice(at, 1); // nothing came: the error says it all
    } else if (at >= 0) {
      msg.stats = statsText(timing, usage, finish, msg.state);
    }
    setBusy(false);
    save();
    render();
  }
}

// The tool calls of the last assistant message that no tool message answers yet.
function pendingCalls() {
  let last = chat.messages.length - 1;
  const answered = new Set();
  while (last >= 0 && chat.messages[last].role === "tool") answered.add(chat.messages[last--].tool_call_id);
  const msg = chat.messages[last];
  if (!msg || msg.role !== "assistant" || !msg.tool_calls) return [];
  return msg.tool_calls.filter((call) => !answered.has(call.id));
}

async function send() {
  const text = $("input").value;
  if (chat.controller || !text.trim()) return;
  $("input").value = "";
  const calls = pendingCalls();
  if (calls.length) {
    chat.messages.push({ role: "tool", tool_call_id: calls[0].id, content: text });
    if (calls.length > 1) {
      render();
      return;
    }
  } else {
    chat.messages.push({ role: "user", content: text });
  }
  await reply();
}

// -- drawing (model output through textContent only) --------------------------------------

function element(tag, className, text) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text !== undefined) node.textContent = text;
  return node;
}

function button(label, action) {
  const node = element("button", null, label);
  node.type = "button";
  node.addEventListener("click", action);
  return node;
}

function roleLabel(msg) {
  if (msg.role !== "tool") return msg.role;
  return `tool result (${msg.tool_call_id})`;
}

function fillMessage(view, msg, index) {
  const open = view.querySelector("details.reasoning")?.open || false; // kept while it streams
  view.replaceChildren(element("div", "role", roleLabel(msg)));
  view.dataset.state = msg.state || "done";
  if (msg.reasoning_content) {
    const fold = element("details", "reasoning");
    fold.open = open;
    fold.append(element("summary", null, "Reasoning"), element("div", "text", msg.reasoning_content));
    view.append(fold);
  }
  view.append(element("div", "content", msg.content || ""));
  for (const call of msg.tool_calls || []) {
    view.append(element("code", "call", `${call.function.name}(${call.function.arguments})`));
  }
  if (msg.stats) view.append(element("div", "stats", msg.stats));
  const actions = messageActions(msg, index);
  if (actions.length) {
    const bar = element("div", "actions");
    bar.append(...actions);
    view.append(bar);
  }
}

function messageActions(msg, index) {
  if (chat.controller) return [];
  const last = index === chat.messages.length - 1;
  if (msg.role === "assistant" && last) return [button("Regenerate", regenerate)];
  const lastUser = chat.messages.map((m) => m.role).lastIndexOf("user");
  if (msg.role === "user" && index === lastUser) return [button("Edit", () => editFrom(index))];
  return [];
}

function render() {
  const log = $("log");
  const chosen = persona();
  const views = [];
  if (chosen) views.push(element("p", "note", `persona: ${chosen.name} (a warm prefix)`));
  else if ($("system").value.trim()) views.push(element("p", "note", "system prompt: see Settings"));
  for (const m of chosen ? chosen.messages.filter((p) => p.role !== "system") : []) {
    views.push(element("article", "msg persona", `${m.role} (persona): ${m.content}`));
  }
  chat.messages.forEach((msg, index) => {
    const view = element("article", `msg ${msg.role}`);
    fillMessage(view, msg, index);
    views.push(view);
  });
  log.replaceChildren(...views);
  const calls = pendingCalls();
  $("input").placeholder = calls.length
    ? `Result of ${calls[0].function.name}(${calls[0].function.arguments})`
    : "Message (Enter sends, Shift+Enter: new line)";
  log.lastElementChild?.scrollIntoView({ block: "end" });
}

function setBusy(busy) {
  $("send").hidden = busy;
  $("stop").hidden = !busy;
}

function showError(text) {
  $("error").hidden = !text;
  $("error").textContent = text || "";
}

// -- actions ------------------------------------------------------------------------------

function regenerate() {
  chat.messages.pop();
  reply();
}

function editFrom(index) {
  $("input").value = chat.messages[index].content;
  chat.messages.splice(index);
  save();
  render();
  $("input").focus();
}

function newChat() {
  chat.controller?.abort();
  chat.messages = [];
  showError(null);
  save();
  render();
  $("input").focus();
}

function askKey(message) {
  sessionStorage.removeItem(KEY_ITEM);
  $("key-message").textContent = message || "This server needs an API key.";
  $("key-form").hidden = false;
  $("key").focus();
}

async function useKey(event) {
  event.preventDefault();
  const key = $("key").value.trim();
  if (!key) return;
  sessionStorage.setItem(KEY_ITEM, key);
  $("key").value = "";
  $("key-form").hidden = true;
  if ((await loadModels()) && chat.retry) {
    chat.retry = false;
    await reply();
  }
}

// -- settings and persistence -------------------------------------------------------------

function fillPersonas() {
  const select = $("persona");
  const kept = select.value || select.dataset.wanted || "";
  select.replaceChildren(element("option", null, "none"));
  select.firstChild.value = "";
  for (const p of chat.personas) {
    const option = element("option", null, p.name);
    option.value = p.name;
    select.append(option);
  }
  select.value = chat.personas.some((p) => p.name === kept) ? kept : "";
  render();
}

function choosePersona() {
  const chosen = persona();
  const system = chosen?.messages.find((m) => m.role === "system");
  $("system").value = system ? system.content : "";
  save();
  render();
}

function editSystem() {
  const system = persona()?.messages.find((m) => m.role === "system");
  if (system && $("system").value !== system.content) $("persona").value = ""; // no longer that prefix
  save();
  render();
}

function save() {
  if (!$("persist").checked) return;
  const saved = {
    messages: chat.messages.filter((m) => m.state !== "streaming"),
    system: $("system").value,
    persona: $("persona").value,
  };
  localStorage.setItem(SAVE_ITEM, JSON.stringify(saved));
}

function restore() {
  $("persist").checked = false; // what is stored says, not what the browser kept of the form
  const text = localStorage.getItem(SAVE_ITEM);
  if (!text) return;
  try {
    const saved = JSON.parse(text);
    chat.messages = Array.isArray(saved.messages) ? saved.messages : [];
    $("system").value = saved.system || "";
    $("persona").dataset.wanted = saved.persona || "";
    $("persist").checked = true;
  } catch {
    localStorage.removeItem(SAVE_ITEM);
  }
}

function togglePersist() {
  if ($("persist").checked) save();
  else localStorage.removeItem(SAVE_ITEM);
}

function start() {
  $("composer").addEventListener("submit", (event) => {
    event.preventDefault();
    send();
  });
  $("input").addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
      event.preventDefault();
      send();
    }
  });
  $("stop").addEventListener("click", () => chat.controller?.abort());
  $("new-chat").addEventListener("click", newChat);
  $("key-form").addEventListener("submit", useKey);
  $("persona").addEventListener("change", choosePersona);
  $("system").addEventListener("input", editSystem);
  $("persist").addEventListener("change", togglePersist);
  restore();
  render();
  loadModels().catch((err) => showError(`cannot reach the server: ${err.message}`));
}

start();
