// The sidebar's conversation list: newest first, a page at a time ("Load more"), a search box
// over the titles listed, and each conversation's Rename and Delete.

import { api, apiJson } from '/static/api.js';
import { apiError } from '/static/stream.js';

const PAGE = 50;
const MAX_PAGE = 200; // the API's largest page

export class ConversationList {
  /**
   * `currentId()`: the conversation shown. `onListed(conversations)`: after each load.
   * `onRenamed(id, title)`, `onDeleted(id)`: after a change succeeded. `onError(message, retryAfterS)`.
   */
  constructor({ list, note, more, search, currentId, onListed, onRenamed, onDeleted, onError }) {
    Object.assign(this, { list, note, more, search, currentId, onListed, onRenamed, onDeleted, onError });
    search.addEventListener('input', () => this.filter());
    this.oldestMs = 0; // updated_at_ms of the last conversation listed
    more.addEventListener('click', () => this.loadMore());
    list.addEventListener('click', (event) => {
      const item = event.target.closest('li');
      if (event.target.closest('.rename')) this.startRename(item);
      else if (event.target.closest('.delete')) this.remove(item);
    });
  }

  /** Loads the newest conversations again, as many as are shown (at least a page). */
  async refresh() {
    const limit = Math.min(MAX_PAGE, Math.max(PAGE, this.list.children.length));
    try {
      const { conversations } = await apiJson(`/v1/conversations?limit=${limit}`);
      if (this.list.querySelector('input')) return; // a rename is being typed: keep the list still
      this.list.replaceChildren(...conversations.map((c) => this.item(c)));
      this.listed(conversations, limit);
    } catch (err) {
      this.showNote(`Could not load conversations: ${err.message}`);
    }
  }

  async loadMore() {
    this.more.disabled = true;
    try {
      // before_ms is exclusive: ask from the last one's time on, so a tie at the edge is not lost.
      const { conversations } = await apiJson(`/v1/conversations?limit=${PAGE}&before_ms=${this.oldestMs + 1}`);
      const shown = new Set([...this.list.querySelectorAll('li')].map((li) => li.dataset.id));
      const added = conversations.filter((c) => !shown.has(c.id));
      this.list.append(...added.map((c) => this.item(c)));
      this.listed(conversations, added.length ? PAGE : Infinity);
    } catch (err) {
      this.onError(`Could not load more conversations: ${err.message}`, err.retryAfterS);
    } finally {
      this.more.disabled = false;
    }
  }

  listed(conversations, limit) {
    if (conversations.length) this.oldestMs = conversations.at(-1).updated_at_ms;
    this.more.hidden = conversations.length < limit;
    this.filter();
    this.onListed(conversations);
  }

  /** Shows only the conversations whose title has the search text (any case). */
  filter() {
    const wanted = this.search.value.trim().toLowerCase();
    let numShown = 0;
    for (const item of this.list.children) {
      const title = (item.querySelector('a') || item.querySelector('input')).textContent || '';
      item.hidden = Boolean(wanted) && !title.toLowerCase().includes(wanted) && !item.querySelector('input');
      numShown += item.hidden ? 0 : 1;
    }
    if (!this.list.children.length) this.showNote('No conversations yet.');
    else if (!numShown) this.showNote(this.more.hidden ? 'No title matches.' : 'No title listed so far matches; load more to search further.');
    else this.showNote('');
  }

  showNote(text) {
    this.note.textContent = text;
    this.note.hidden = !text;
  }

  item(conversation) {
    const link = document.createElement('a');
    link.href = `#${conversation.id}`;
    link.dataset.id = conversation.id;
    link.textContent = conversation.title || 'Untitled';
    link.title = new Date(conversation.updated_at).toLocaleString();
    const item = document.createElement('li');
    item.dataset.id = conversation.id;
    item.append(link, actionButton('rename', '✎', 'Rename'), actionButton('delete', '✕', 'Delete'));
    this.markCurrentIn(item);
    return item;
  }

  markCurrent() {
    for (const item of this.list.children) this.markCurrentIn(item);
  }

  markCurrentIn(item) {
    const link = item.querySelector('a');
    if (link && item.dataset.id === this.currentId()) link.setAttribute('aria-current', 'page');
    else if (link) link.removeAttribute('aria-current');
  }

  startRename(item) {
    const link = item.querySelector('a');
    const input = document.createElement('input');
    input.className = 'rename-input';
    input.value = link.textContent;
    input.maxLength = 200;
    input.setAttribute('aria-label', 'New title');
    let isDone = false;
    const finish = async (save) => {
      if (isDone) return;
      isDone = true;
      const title = input.value.trim();
      input.replaceWith(link);
      if (save && title && title !== link.textContent) await this.rename(item.dataset.id, link, title);
    };
    input.addEventListener('keydown', (event) => {
      if (event.key === 'Enter') finish(true);
      else if (event.key === 'Escape') finish(false);
    });
    input.addEventListener('blur', () => finish(true));
    link.replaceWith(input);
    input.focus();
    input.select();
  }

  async rename(id, link, title) {
    const before = link.textContent;
    link.textContent = title;
    try {
      const changed = await apiJson(`/v1/conversations/${encodeURIComponent(id)}`, { method: 'PATCH', body: { title } });
      link.textContent = changed.title;
      this.filter();
      this.onRenamed(id, changed.title);
    } catch (err) {
      link.textContent = before;
      this.onError(`Could not rename the conversation: ${err.message}`, err.retryAfterS);
    }
  }

  async remove(item) {
    const title = item.querySelector('a, input').textContent || 'this conversation';
    if (!window.confirm(`Delete “${title}”? This cannot be undone.`)) return;
    const id = item.dataset.id;
    const response = await api(`/v1/conversations/${encodeURIComponent(id)}`, { method: 'DELETE' });
    if (!response.ok && response.status !== 404) {
      const err = await apiError(response);
      this.onError(`Could not delete the conversation: ${err.message}`, err.retryAfterS);
      return;
    }
    item.remove();
    this.filter();
    this.onDeleted(id);
  }
}

function actionButton(className, symbol, label) {
  const button = document.createElement('button');
  button.type = 'button';
  button.className = `icon-action ${className}`;
  button.textContent = symbol;
  button.title = label;
  button.setAttribute('aria-label', label);
  return button;
}
