// One message on the page: an <article> that keeps its text in data-source, with a foot line for
// its status, its error, its versions (‹ 1/2 › between regenerated answers or edited messages),
// Edit (a user's message), and Regenerate and thumbs up and down (an answer). A user's text is shown as a text node; an
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
const USER_STATUS_TEXT = { moderated: 'Not sent to the model: refused by the safety check' };

function linkButton(className, text, label, onClick) {
  const button = document.createElement('button');
  button.type = 'button';
  button.className = `link ${className}`;
  button.textContent = text;
  if (label) button.setAttribute('aria-label', label);
  button.addEventListener('click', onClick);
  return button;
}

/** The ‹ i/n › switcher between a message's versions; hidden while there is only one. */
function versionsElement(el, onSwitch) {
  const nav = document.createElement('span');
  nav.className = 'versions';
  nav.hidden = true;
  const count = document.createElement('span');
  count.className = 'version-count';
  nav.append(
    linkButton('version-prev', '‹', 'Previous version', () => onSwitch(el, -1)),
    count,
    linkButton('version-next', '›', 'Next version', () => onSwitch(el, 1)),
  );
  return nav;
}

/** 👍 👎 under an answer: `onRate(el, rating)`; the one given is pressed (setRating). */
function ratingElement(el, onRate) {
  const box = document.createElement('span');
  box.className = 'rating';
  box.hidden = true;
  box.append(
    linkButton('rate-up', '👍', 'Good answer', () => onRate(el, 'up')),
    linkButton('rate-down', '👎', 'Bad answer', () => onRate(el, 'down')),
  );
  return box;
}

/** Shows `rating` ('up', 'down', or '' for none) as the pressed thumb. */
export function setRating(el, rating) {
  if (rating) el.dataset.rating = rating;
  else delete el.dataset.rating;
  for (const vote of ['up', 'down']) {
    el.querySelector(`.rate-${vote}`)?.setAttribute('aria-pressed', String(vote === rating));
  }
}

/**
 * A message as the API gives it (`{id, role, content, status, feedback}`). `actions`:
 * regenerate(el) and rate(el, rating) for answers, edit(el) for a user's messages,
 * switchVersion(el, step) for both.
 */
export function messageElement({ id = '', role, content = '', status = 'complete', tokens = 0, feedback = null }, actions = {}) {
  const { regenerate = () => {}, rate = () => {}, edit = () => {}, switchVersion = () => {} } = actions;
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
  foot.append(versionsElement(el, switchVersion), statusLine, errorLine, usage);
  if (role === 'assistant') {
    const again = linkButton('regenerate', 'Regenerate', '', () => regenerate(el));
    again.hidden = true;
    foot.append(again, ratingElement(el, rate));
  } else {
    const change = linkButton('edit', 'Edit', 'Edit this message', () => edit(el));
    change.hidden = true;
    foot.append(change);
  }
  el.append(body, foot);
  el.dataset.source = content;
  setStatus(el, status);
  if (role === 'assistant') setRating(el, feedback ? feedback.rating : '');
  if (role === 'assistant' && status !== 'running' && tokens > 0) setUsage(el, { output: tokens });
  return el;
}

/** The answer's token usage, discreetly: `{output}` as stored, or the done event's `{input, cached, output}`. */
export function setUsage(el, { input, cached = 0, output = 0 } = {}) {
  const line = el.querySelector('.usage');
  line.textContent = output ? `${output} token${output === 1 ? '' : 's'}` : '';
  line.title = input === undefined ? '' : `prompt ${input} tokens (${cached} cached), answer ${output} tokens`;
}

/** Shows "‹ index/count ›" (index from 1); nothing while count is 1. */
export function setVersions(el, index, count) {
  const nav = el.querySelector('.versions');
  nav.hidden = count < 2;
  nav.querySelector('.version-count').textContent = `${index}/${count}`;
  nav.querySelector('.version-prev').disabled = index <= 1;
  nav.querySelector('.version-next').disabled = index >= count;
}

/**
 * Turns a user's message into a box to edit it: `onSave(text)` when saved (Enter or Save) with a
 * change, back as it was on Cancel or Esc.
 */
export function startEditing(el, onSave) {
  if (el.querySelector('.edit-box')) return;
  const body = el.querySelector('.content');
  const box = document.createElement('form');
  box.className = 'edit-box';
  const input = document.createElement('textarea');
  input.className = 'edit-input';
  input.setAttribute('aria-label', 'Edit the message');
  input.value = el.dataset.source;
  input.rows = Math.min(12, input.value.split('\n').length + 1);
  const save = document.createElement('button');
  save.type = 'submit';
  save.className = 'button primary edit-save';
  save.textContent = 'Save and send';
  const cancel = linkButton('edit-cancel', 'Cancel', '', () => finish());
  const actions = document.createElement('div');
  actions.className = 'edit-actions';
  actions.append(cancel, save);
  box.append(input, actions);
  const finish = () => {
    box.remove();
    body.hidden = false;
  };
  box.addEventListener('submit', (event) => {
    event.preventDefault();
    const text = input.value;
    if (!text.trim()) return;
    finish();
    if (text !== el.dataset.source) onSave(text);
  });
  input.addEventListener('keydown', (event) => {
    if (event.key === 'Enter' && !event.shiftKey && !event.isComposing) {
      event.preventDefault();
      box.requestSubmit();
    } else if (event.key === 'Escape') {
      event.preventDefault();
      event.stopPropagation();
      finish();
    }
  });
  body.hidden = true;
  body.after(box);
  input.focus();
}

/**
 * The note that the conversation's older turns reach the model as a summary (`{text, upto_seq}`
 * from the API), placed above the first shown message after the last it covers (`views`: the shown
 * messages, in order); none on a branch it does not cover. The summary is model output: shown as text.
 */
export function placeSummaryNote(list, views, summary) {
  list.querySelector('.summary-note')?.remove();
  if (!summary) return;
  const last = views.findIndex((view) => view.seq === summary.upto_seq); // absent on another branch
  if (last < 0 || last === views.length - 1) return;
  const note = document.createElement('details');
  note.className = 'summary-note';
  const label = document.createElement('summary');
  label.textContent = 'Earlier messages are summarised';
  const text = document.createElement('p');
  text.textContent = summary.text;
  note.append(label, text);
  list.querySelectorAll('.message')[last + 1].before(note);
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
  el.querySelector('.status').textContent = note || (el.dataset.role === 'assistant' ? STATUS_TEXT : USER_STATUS_TEXT)[status] || '';
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
