// Tandem's chat page: conversations, the composer, and replies streamed over the product API.
// Model output reaches the page only through messages.js: sanitised Markdown, never raw HTML.

import { api, apiJson, streamHeaders, useKey, uuid } from '/static/api.js';
import { branchThrough, buildTree, pathTo, versionsOf } from '/static/branches.js';
import {
  appendText, keepingBottom, messageElement, placeSummaryNote, scrollToBottom, setError, setRating, setStatus, setText, setUsage, setVersions, startEditing,
  textOf,
} from '/static/messages.js';
import { ConversationList } from '/static/conversations.js';
import { refusalText, retryText, waitText } from '/static/refusals.js';
import { apiError, followReply } from '/static/stream.js';
import { setUpThemeToggle } from '/static/theme.js';

const KEY_STORAGE = 'tandem.apiKey';
const MODEL_STORAGE = 'tandem.model';
const $ = (id) => document.getElementById(id);
const ui = {
  sidebar: $('sidebar'), toggleSidebar: $('toggle-sidebar'), list: $('conversations'), listNote: $('conversations-note'),
  loadMore: $('load-more'), search: $('search'),
  newChat: $('new-chat'), changeKey: $('change-key'), theme: $('theme'), title: $('chat-title'), model: $('model'),
  messages: $('messages'), empty: $('empty'), banner: $('banner'),
  composer: $('composer'), input: $('input'), send: $('send'), stop: $('stop'),
  keyDialog: $('key-dialog'), keyForm: $('key-form'), keyInput: $('api-key'), keyError: $('key-error'),
};

const state = {
  key: localStorage.getItem(KEY_STORAGE) || '',
  conversationId: '',
  active: null, // the reply being followed: {el, controller, messageId, stopping}
  isStarting: false, // a new conversation is being created for the first send
  sendHeldUntilMs: 0,
  tree: buildTree([]), // every message of the open conversation, for switching between versions
  summary: null, // the open conversation's summary ({text, upto_seq}) if it has one
};

// ---- the API key ---------------------------------------------------------------------------------

function askForKey(problem = '') {
  ui.keyError.textContent = problem;
  ui.keyError.hidden = !problem;
  ui.keyInput.value = '';
  if (!ui.keyDialog.open) ui.keyDialog.showModal();
  ui.keyInput.focus();
}

ui.keyForm.addEventListener('submit', () => {
  state.key = ui.keyInput.value.trim();
  localStorage.setItem(KEY_STORAGE, state.key);
  start();
});
ui.keyDialog.addEventListener('cancel', (event) => {
  if (!state.key) event.preventDefault(); // nothing works without one
});
ui.changeKey.addEventListener('click', () => askForKey());

// ---- the banner: errors that belong to no message --------------------------------------------------

let bannerTimer = 0;

/** `message`, then (for a refusal's `status`) when to try again, counting down from Retry-After. */
function showBanner(message, retryAfterS = 0, status = 0) {
  clearInterval(bannerTimer);
  const until = Date.now() + retryAfterS * 1000;
  const render = () => {
    const left = Math.ceil((until - Date.now()) / 1000);
    ui.banner.textContent = [message, retryText(status, left)].filter(Boolean).join(' ');
    if (left <= 0) clearInterval(bannerTimer);
  };
  render();
  if (retryAfterS > 0) bannerTimer = setInterval(render, 1000);
  ui.banner.hidden = false;
}

/** A refused request (429, 413, 503 ...): what happened, and when to try again. */
function showRefusal(error) {
  showBanner(refusalText(error.status, error.message, error.code), error.retryAfterS, error.status);
}

function hideBanner() {
  clearInterval(bannerTimer);
  ui.banner.hidden = true;
  ui.banner.textContent = '';
}

let holdTimer = 0;

function holdSending(retryAfterS) {
  if (retryAfterS <= 0) return;
  state.sendHeldUntilMs = Date.now() + retryAfterS * 1000;
  clearInterval(holdTimer);
  holdTimer = setInterval(() => {
    updateControls();
    if (Date.now() >= state.sendHeldUntilMs) clearInterval(holdTimer);
  }, 500);
  updateControls();
}

// ---- conversations -------------------------------------------------------------------------------

const conversations = new ConversationList({
  list: ui.list,
  note: ui.listNote,
  more: ui.loadMore,
  search: ui.search,
  currentId: () => state.conversationId,
  onListed(listed) {
    const current = listed.find((c) => c.id === state.conversationId);
    if (current && current.title) ui.title.textContent = current.title;
  },
  onRenamed(id, title) {
    if (id === state.conversationId) ui.title.textContent = title;
  },
  onDeleted(id) {
    if (id === state.conversationId) showNewChat();
  },
  onError: showBanner,
});
const refreshConversations = () => conversations.refresh();
const markCurrent = () => conversations.markCurrent();

function leaveConversation() {
  if (state.active) state.active.controller.abort(); // the reply goes on server-side; we reattach on return
  state.active = null;
  state.tree = buildTree([]);
  state.summary = null;
  hideBanner();
  ui.messages.replaceChildren(ui.empty);
  ui.empty.hidden = false;
  updateControls();
}

function showNewChat() {
  leaveConversation();
  state.conversationId = '';
  ui.title.textContent = 'New chat';
  history.replaceState(null, '', location.pathname);
  markCurrent();
  ui.input.focus();
}

async function openConversation(id) {
  leaveConversation();
  state.conversationId = id;
  markCurrent();
  let conversation;
  try {
    conversation = await apiJson(`/v1/conversations/${encodeURIComponent(id)}`);
  } catch (err) {
    if (state.conversationId === id) showBanner(`Could not open the conversation: ${err.message}`, err.retryAfterS, err.status);
    return;
  }
  if (state.conversationId !== id) return; // another one was opened meanwhile
  renderConversation(conversation);
}

function renderConversation(conversation) {
  ui.title.textContent = conversation.title || 'New chat';
  state.tree = buildTree(conversation.tree || conversation.messages);
  state.summary = conversation.summary; // its older turns reach the model as this: a note above the rest
  renderBranch(conversation.messages);
}

/** Shows one branch of the conversation; `focusId`: a message to keep in view (else the end). */
function renderBranch(views, focusId = '') {
  ui.messages.replaceChildren(ui.empty);
  ui.empty.hidden = views.length > 0;
  for (const view of views) ui.messages.append(messageElement(view, messageActions));
  placeSummaryNote(ui.messages, views, state.summary);
  markLastAnswer();
  const focus = focusId && ui.messages.querySelector(`.message[data-id="${CSS.escape(focusId)}"]`);
  if (focus) focus.scrollIntoView({ block: 'nearest' });
  else scrollToBottom(ui.messages);
  const last = views.at(-1);
  if (last && last.role === 'assistant' && last.status === 'running') {
    // Attach from the start (Last-Event-ID 0): its text replaces the partial text shown.
    followStream(lastMessageEl(), { messageId: last.id, replaceText: true });
  }
  updateControls();
}

// ---- versions: regenerated answers and edited messages --------------------------------------------

/** ‹ i/n › on a message: shows the branch through its sibling `step` away. */
function switchVersion(el, step) {
  if (state.active || !el.dataset.id) return;
  const { sibling } = versionsOf(state.tree, el.dataset.id, step);
  if (!sibling) return;
  hideBanner();
  renderBranch(branchThrough(state.tree, sibling.id), sibling.id);
}

/**
 * After a reply ends: reads the conversation's tree again, so the messages just written get their
 * ids (a user's message has none until then) and their versions show.
 */
async function syncTree(conversationId, answerId) {
  let conversation;
  try {
    conversation = await apiJson(`/v1/conversations/${encodeURIComponent(conversationId)}`);
  } catch {
    return; // the versions show on the next open
  }
  if (state.conversationId !== conversationId || state.active) return;
  state.tree = buildTree(conversation.tree || conversation.messages);
  const path = pathTo(state.tree, answerId);
  const shown = [...ui.messages.querySelectorAll('.message')];
  if (path.length && path.length === shown.length) {
    shown.forEach((el, i) => {
      el.dataset.id = path[i].id;
    });
    keepingBottom(ui.messages, updateControls); // Edit and ‹ i/n › may appear below the reader's last line
  } else if (path.length) {
    renderBranch(path);
  }
}

function editMessage(el) {
  if (state.active || !el.dataset.id) return;
  startEditing(el, (content) => sendEdit(el, content));
}

/** Rates an answer (👍 'up', 👎 'down'); rating it again replaces the rating. */
async function rate(el, rating) {
  const messageId = el.dataset.id;
  if (!messageId) return;
  try {
    const response = await api(`/v1/messages/${encodeURIComponent(messageId)}/feedback`, { method: 'POST', body: { rating } });
    if (!response.ok) throw await apiError(response);
  } catch (err) {
    showBanner(`Could not save the rating: ${err.message}`, err.retryAfterS, err.status);
    return;
  }
  if (el.dataset.id === messageId) setRating(el, rating); // not if it was regenerated meanwhile
}

const messageActions = { regenerate, rate, edit: editMessage, switchVersion };

// ---- messages ------------------------------------------------------------------------------------

const lastMessageEl = () => ui.messages.querySelector('.message:last-of-type');

function markLastAnswer() {
  for (const el of ui.messages.querySelectorAll('.message[data-last-answer]')) delete el.dataset.lastAnswer;
  const last = lastMessageEl();
  if (last && last.dataset.role === 'assistant') last.dataset.lastAnswer = '';
  keepingBottom(ui.messages, updateControls); // Regenerate may appear below the reader's last line
}

// ---- replies -------------------------------------------------------------------------------------

/**
 * Streams a reply into `el` until it ends: from `start` (a POST) or, given `messageId`, from its
 * stream. `replaceText`: the text shown is the partial text, replaced by the stream from event 1.
 */
function followStream(el, { start = null, messageId = '', replaceText = false, onRefused = () => {} }) {
  const conversationId = state.conversationId;
  const controller = new AbortController();
  const active = { el, controller, messageId, stopping: false };
  state.active = active;
  setStatus(el, 'running');
  setError(el, '');
  updateControls();
  const isMine = () => state.active === active;

  const on = {
    meta(data) {
      active.messageId = data.message_id;
      el.dataset.id = data.message_id;
      if (replaceText) setText(el, '');
      refreshConversations(); // the first message gives the conversation its title
      updateControls();
    },
    delta(data) {
      appendText(el, data.text);
    },
    done(data) {
      const stopped = data.finish === 'cancelled';
      setUsage(el, data.usage);
      setStatus(el, stopped ? 'stopped' : 'complete', data.finish === 'length' ? 'Cut short at the length limit' : '');
    },
    moderated(data) {
      // The output check withdrew the answer: the text shown so far goes, and the reader is told why.
      setText(el, '');
      setStatus(el, 'moderated');
      setError(el, data.message || 'This answer was withdrawn by the safety check.');
    },
    error(data) {
      setStatus(el, data.code === 'moderated' ? 'moderated' : 'failed');
      const wait = data.retry_after ? ` Try again in ${waitText(data.retry_after)}.` : '';
      setError(el, `${data.message || 'The reply failed.'}${wait}`);
      holdRegenerate(el, data.retry_after || 0);
    },
    failed(error, { atStart }) {
      if (atStart) {
        onRefused(error);
        return;
      }
      // The reply can no longer be streamed (its log expired, or it is gone): show what is stored.
      if (!isMine()) return;
      openConversation(state.conversationId).then(() => {
        if (error.status !== 410) showRefusal(error);
      });
    },
    reconnecting(delayMs) {
      el.dataset.connection = 'lost';
      setStatus(el, 'running', `Connection lost; reconnecting in ${Math.max(1, Math.round(delayMs / 1000))} s…`);
    },
    connected() {
      delete el.dataset.connection;
      if (el.dataset.status === 'running') setStatus(el, 'running');
    },
  };
  followReply({
    start,
    resume: (id, lastEventId, signal) => api(`/v1/messages/${encodeURIComponent(id)}/stream`, { headers: streamHeaders(lastEventId), signal }),
    messageId,
    on,
    signal: controller.signal,
  }).then((ending) => {
    if (!isMine()) return;
    state.active = null;
    if (ending === 'abandoned' && el.dataset.status === 'running') setStatus(el, 'running', 'Not following this reply');
    markLastAnswer();
    refreshConversations();
    if ((ending === 'done' || ending === 'error' || ending === 'moderated') && active.messageId) syncTree(conversationId, active.messageId);
  });
}

function holdRegenerate(el, retryAfterS) {
  if (retryAfterS <= 0) return;
  el.dataset.heldUntil = String(Date.now() + retryAfterS * 1000);
  updateControls();
  setTimeout(updateControls, retryAfterS * 1000 + 50);
}

async function send(content) {
  if (!content.trim() || state.active || state.isStarting || Date.now() < state.sendHeldUntilMs) return;
  hideBanner();
  let conversationId = state.conversationId;
  if (!conversationId) {
    state.isStarting = true; // a second Enter meanwhile must not start a second conversation
    try {
      ({ id: conversationId } = await apiJson('/v1/conversations', { method: 'POST', body: {} }));
    } catch (err) {
      showBanner(`Could not start a conversation: ${err.message}`, err.retryAfterS, err.status);
      return;
    } finally {
      state.isStarting = false;
    }
    if (state.conversationId) return; // the reader moved to another conversation meanwhile
    state.conversationId = conversationId;
    history.replaceState(null, '', `#${conversationId}`);
  }
  ui.input.value = '';
  autosize();
  ui.empty.hidden = true;
  // The new turn follows the answer shown last (the reader may have switched to another version).
  const last = lastMessageEl();
  const parentId = last && last.dataset.role === 'assistant' ? last.dataset.id || '' : '';
  const answer = messageElement({ role: 'assistant', content: '', status: 'running' }, messageActions);
  keepingBottom(ui.messages, () => ui.messages.append(messageElement({ role: 'user', content }, messageActions), answer));
  scrollToBottom(ui.messages);
  const body = { content, model: ui.model.value || 'auto' };
  if (parentId) body.parent_id = parentId;
  startTurn(conversationId, answer, body);
}

/** A sent message's new version: it and what follows make way, and the new one is answered. */
function sendEdit(el, content) {
  if (state.active || Date.now() < state.sendHeldUntilMs || !el.dataset.id) return;
  hideBanner();
  const editOf = el.dataset.id;
  while (el.nextElementSibling) el.nextElementSibling.remove();
  const user = messageElement({ role: 'user', content }, messageActions);
  el.replaceWith(user);
  const answer = messageElement({ role: 'assistant', content: '', status: 'running' }, messageActions);
  ui.messages.append(answer);
  scrollToBottom(ui.messages);
  startTurn(state.conversationId, answer, { content, model: ui.model.value || 'auto', edit_of: editOf });
}

/** Posts a user turn and streams its answer into `answer`. */
function startTurn(conversationId, answer, body) {
  const { content } = body;
  // One key per send, reused when the same send is retried after a network failure.
  const idempotencyKey = uuid();
  followStream(answer, {
    start: (lastEventId, signal) => api(`/v1/conversations/${encodeURIComponent(conversationId)}/messages`, {
      method: 'POST', body, signal, headers: streamHeaders(lastEventId, { 'Idempotency-Key': idempotencyKey }),
    }),
    onRefused: (error) => refused(error, conversationId, content),
  });
}

/** A send the server refused: say why, show what was stored, give the text back if it was not. */
async function refused(error, conversationId, content) {
  state.active = null;
  await openConversation(conversationId);
  showRefusal(error);
  holdSending(error.retryAfterS);
  const last = lastMessageEl();
  if (last && last.dataset.status === 'failed') holdRegenerate(last, error.retryAfterS); // its Regenerate is the retry
  const users = ui.messages.querySelectorAll('.message[data-role="user"]');
  const stored = users.length && textOf(users[users.length - 1]) === content;
  if ((!stored || error.code === 'moderated') && !ui.input.value) { // a refused input comes back to rephrase
    ui.input.value = content;
    autosize();
  }
  refreshConversations();
}

function regenerate(el) {
  const messageId = el.dataset.id;
  if (!messageId || state.active) return;
  hideBanner();
  setText(el, '');
  setUsage(el);
  setRating(el, '');
  delete el.dataset.id;
  followStream(el, {
    start: (_, signal) => api(`/v1/messages/${encodeURIComponent(messageId)}/regenerate`, {
      method: 'POST', body: { model: ui.model.value === 'auto' ? '' : ui.model.value }, headers: streamHeaders(0), signal,
    }),
    onRefused: (error) => {
      state.active = null;
      openConversation(state.conversationId).then(() => showRefusal(error));
    },
  });
}

async function stop() {
  const active = state.active;
  if (!active || !active.messageId || active.stopping) return;
  active.stopping = true;
  updateControls();
  try {
    const response = await api(`/v1/messages/${encodeURIComponent(active.messageId)}/stop`, { method: 'POST' });
    if (!response.ok) throw await apiError(response);
    // The stream ends with done (finish "cancelled"), which marks the message stopped.
  } catch (err) {
    active.stopping = false;
    showBanner(`Could not stop the reply: ${err.message}`, err.retryAfterS, err.status);
    updateControls();
  }
}

// ---- controls ------------------------------------------------------------------------------------

function updateControls() {
  const active = state.active;
  ui.stop.hidden = !active;
  ui.send.hidden = Boolean(active);
  ui.stop.disabled = !active || !active.messageId || active.stopping;
  ui.stop.textContent = active && active.stopping ? 'Stopping…' : 'Stop';
  const heldS = Math.ceil((state.sendHeldUntilMs - Date.now()) / 1000);
  ui.send.disabled = heldS > 0;
  ui.send.textContent = heldS > 0 ? `Wait ${heldS} s` : 'Send';
  for (const button of ui.messages.querySelectorAll('.regenerate')) {
    const el = button.closest('.message');
    const held = Number(el.dataset.heldUntil || 0) > Date.now();
    button.hidden = active !== null || !('lastAnswer' in el.dataset) || !el.dataset.id;
    button.disabled = held;
  }
  for (const button of ui.messages.querySelectorAll('.edit')) {
    button.hidden = active !== null || !button.closest('.message').dataset.id;
  }
  for (const box of ui.messages.querySelectorAll('.rating')) {
    const el = box.closest('.message');
    box.hidden = !el.dataset.id || el.dataset.status === 'running';
  }
  for (const el of ui.messages.querySelectorAll('.message')) {
    const { index, count } = el.dataset.id ? versionsOf(state.tree, el.dataset.id) : { index: 1, count: 1 };
    setVersions(el, index, count);
    if (active) for (const button of el.querySelectorAll('.versions button')) button.disabled = true;
  }
}

function autosize() {
  ui.input.style.height = 'auto';
  ui.input.style.height = `${Math.min(ui.input.scrollHeight, 240)}px`;
}

ui.composer.addEventListener('submit', (event) => {
  event.preventDefault();
  send(ui.input.value);
});
ui.input.addEventListener('keydown', (event) => {
  if (event.key === 'Enter' && !event.shiftKey && !event.isComposing) {
    event.preventDefault();
    send(ui.input.value);
  }
});
ui.input.addEventListener('input', autosize);
// Esc stops the reply being written (unless a dialog or a rename is taking the key);
// Ctrl+Shift+O (Cmd+Shift+O on a Mac) starts a new chat.
document.addEventListener('keydown', (event) => {
  if (event.key === 'Escape' && state.active && !ui.keyDialog.open && !event.target.closest('.rename-input')) {
    event.preventDefault();
    stop();
  } else if ((event.ctrlKey || event.metaKey) && event.shiftKey && event.key.toLowerCase() === 'o') {
    event.preventDefault();
    showNewChat();
  }
});
ui.stop.addEventListener('click', stop);
ui.newChat.addEventListener('click', () => {
  showNewChat();
  closeSidebar();
});
ui.list.addEventListener('click', (event) => {
  if (event.target.closest('a')) closeSidebar();
});
ui.toggleSidebar.addEventListener('click', () => {
  const open = ui.sidebar.classList.toggle('open');
  ui.toggleSidebar.setAttribute('aria-expanded', String(open));
});
ui.model.addEventListener('change', () => localStorage.setItem(MODEL_STORAGE, ui.model.value));

function closeSidebar() {
  ui.sidebar.classList.remove('open');
  ui.toggleSidebar.setAttribute('aria-expanded', 'false');
}

window.addEventListener('hashchange', () => {
  const id = decodeURIComponent(location.hash.slice(1));
  if (id === state.conversationId) return;
  if (id) openConversation(id);
  else showNewChat();
});

// ---- start ---------------------------------------------------------------------------------------

async function loadModels() {
  try {
    const { data } = await apiJson('/v1/models');
    const chosen = localStorage.getItem(MODEL_STORAGE) || 'auto';
    const names = ['auto', ...data.map((m) => m.id).filter((id) => id !== 'auto')];
    ui.model.replaceChildren(...names.map((name) => new Option(name, name, false, name === chosen)));
  } catch {
    // "auto" stays the only choice
  }
}

setUpThemeToggle(ui.theme);

function start() {
  if (!state.key) {
    askForKey();
    return;
  }
  useKey(state.key, () => askForKey('That API key was refused. Enter a valid one.'));
  document.body.dataset.ready = '';
  refreshConversations();
  loadModels();
  const id = decodeURIComponent(location.hash.slice(1));
  if (id) openConversation(id);
  else showNewChat();
}

start();
