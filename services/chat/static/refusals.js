// A refused request (429 over a limit, 413 too large, 503 unavailable) as a message that says what
// happened and when to try again, from the server's message and its Retry-After.

const LEADS = {
  413: 'Too long to send',
  429: 'Too many requests',
  503: 'Unavailable right now',
};

/** "45 seconds", "2 minutes", "1 hour": how long, rounded up, in the largest unit that fits. */
export function waitText(seconds) {
  const s = Math.max(1, Math.ceil(seconds));
  const [n, unit] = s < 60 ? [s, 'second'] : s < 3600 ? [Math.ceil(s / 60), 'minute'] : [Math.ceil(s / 3600), 'hour'];
  return `${n} ${unit}${n === 1 ? '' : 's'}`;
}

/** The sentence that ends a refusal's message, `leftS` seconds before it may be retried. */
export function retryText(status, leftS) {
  if (leftS > 0) return `Try again in ${waitText(leftS)}.`;
  if (status === 413) return 'Shorten it and send it again.';
  return status === 429 || status >= 500 ? 'You can try again now.' : '';
}

/** The message's first part: what kind of refusal, then the server's own words (a refused input's, as said). */
export function refusalText(status, message, code = '') {
  if (code === 'moderated') return message;
  const lead = LEADS[status];
  const said = message.replace(/[;,.]?\s*try again( shortly| later| in \d+ (second|minute|hour)s?)?\.?$/i, '').replace(/\.$/, '').trim();
  return lead ? `${lead}: ${said}.` : `${said}.`;
}
