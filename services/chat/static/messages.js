// One message on the page: an <article> that keeps its text in data-source, with a foot line for
// its status, its error and (for answers) Regenerate. A user's text is shown as a text node; an
// answer is rendered as sanitised Markdown (markdown.js), at most every RENDER_EVERY_MS while it
// streams and at once when it ends.

import { renderMarkdown } from '/static/markdown.js';

const RENDER_EVERY_MS = 50;
const pendingRenders = new WeakMap(); // element -> timer of its next render

const STATUS_TEXT = {
  running: 'Writing…',
  stopped: 'Stopped',
  failed: 'Failed',
  moderated: 'Withheld by the safety check',
};

/** A message as the API gives it (`{id, role, content, status}`); `onRegenerate(el)` for answers. */
export function messageElement({ id = '', role, content = '', status = 'complete', tokens = 0 }, onRegenerate) {
  const el = document.createElement('article');
  el.className = 'message';
  el.dataset.role = role;
  if (id) el.dataset.id = id;
  const body = document.createElement('div');
  body.className = 'content';
  const foot = document.createElement('div');
  foot.className = 'message-foot';
  const statusLine = document.createElement('span');
  statusLine.className = 'status';
  const errorLine = document.createElement('span');
  errorLine.className = 'error-line';
  errorLine.setAttribute('role', 'alert');
  const usage = document.createElement('span');
  usage.className = 'usage';
  foot.append(statusLine, errorLine, usage);
  if (role === 'assistant') {
    const again = document.createElement('button');
    again.type = 'button';
    again.className = 'link regenerate';
    again.textContent = 'Regenerate';
    again.hidden = true;
    again.addEventListener('click', () => onRegenerate(el));
    foot.append(again);
  }
  el.append(body, foot);
  el.dataset.source = content;
  setStatus(el, status);
  if (role === 'assistant' && status !== 'running' && tokens > 0) setUsage(el, { output: tokens });
  return el;
}

/** The answer's token usage, discreetly: `{output}` as stored, or the done event's `{input, cached, output}`. */
export function setUsage(el, { input, cached = 0, output = 0 } = {}) {
  const line = el.querySelector('.usage');
  line.textContent = output ? `${output} token${output === 1 ? '' : 's'}` : '';
  line.title = input === undefined ? '' : `prompt ${input} tokens (${cached} cached), answer ${output} tokens`;
}

export const textOf = (el) => el.dataset.source;

export function setText(el, text) {
  el.dataset.source = text;
  showText(el);
}

/** Appends a streamed piece of an answer; it is shown within RENDER_EVERY_MS. */
export function appendText(el, text) {
  el.dataset.source += text;
  if (!pendingRenders.has(el)) pendingRenders.set(el, setTimeout(() => showText(el), RENDER_EVERY_MS));
}

function showText(el) {
  clearTimeout(pendingRenders.get(el));
  pendingRenders.delete(el);
  const body = el.querySelector('.content');
  const render = () => {
    if (el.dataset.role === 'assistant') renderMarkdown(body, el.dataset.source, el.dataset.status !== 'running');
    else body.textContent = el.dataset.source;
  };
  const list = el.closest('.messages');
  if (list) keepingBottom(list, render);
  else render();
}

/** Sets the status line; the text is rendered anew (an ended answer's code is highlighted in full). */
export function setStatus(el, status, note = '') {
  const isChange = el.dataset.status !== status;
  el.dataset.status = status;
  el.querySelector('.status').textContent = note || (el.dataset.role === 'assistant' ? STATUS_TEXT[status] || '' : '');
  if (isChange || pendingRenders.has(el)) showText(el);
}

export function setError(el, message) {
  el.querySelector('.error-line').textContent = message;
}

export function scrollToBottom(list) {
  list.scrollTop = list.scrollHeight;
}

/** Runs `change`, then keeps `list` at its bottom if the reader was there (not if they scrolled up). */
export function keepingBottom(list, change) {
  const isNearBottom = list.scrollHeight - list.scrollTop - list.clientHeight < 80;
  change();
  if (isNearBottom) scrollToBottom(list);
}
