// One message on the page: an <article> whose text is only ever set as text nodes, with a foot
// line for its status, its error and (for answers) Regenerate.

const STATUS_TEXT = {
  running: 'Writing…',
  stopped: 'Stopped',
  failed: 'Failed',
  moderated: 'Withheld by the safety check',
};

/** A message as the API gives it (`{id, role, content, status}`); `onRegenerate(el)` for answers. */
export function messageElement({ id = '', role, content = '', status = 'complete' }, onRegenerate) {
  const el = document.createElement('article');
  el.className = 'message';
  el.dataset.role = role;
  if (id) el.dataset.id = id;
  const body = document.createElement('div');
  body.className = 'content';
  body.append(document.createTextNode(content)); // the one text node replies append to
  const foot = document.createElement('div');
  foot.className = 'message-foot';
  const statusLine = document.createElement('span');
  statusLine.className = 'status';
  const errorLine = document.createElement('span');
  errorLine.className = 'error-line';
  errorLine.setAttribute('role', 'alert');
  foot.append(statusLine, errorLine);
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
  setStatus(el, status);
  return el;
}

/** The text node a reply's deltas are appended to. */
export const textNodeOf = (el) => el.querySelector('.content').firstChild;
export const textOf = (el) => el.querySelector('.content').textContent;

export function setStatus(el, status, note = '') {
  el.dataset.status = status;
  el.querySelector('.status').textContent = note || (el.dataset.role === 'assistant' ? STATUS_TEXT[status] || '' : '');
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
