// A conversation is a tree: each message follows its parent (`parent_id`, null at the root).
// Regenerating an answer adds a sibling to it, editing a sent message a sibling to that message.
// The page shows one branch, root to tip; where a message has siblings, ‹ i/n › switches between
// them, and below the one chosen it follows the branch that was written to last (as the server's
// own `messages` does).

const ROOT = '';

/** The tree of a conversation from the API's `tree` (every message, in seq order). */
export function buildTree(views) {
  const nodes = new Map(views.map((view) => [view.id, view]));
  const children = new Map();
  for (const view of views) {
    const parent = view.parent_id && nodes.has(view.parent_id) ? view.parent_id : ROOT;
    if (!children.has(parent)) children.set(parent, []);
    children.get(parent).push(view);
  }
  // The newest seq under each message (itself included): a parent's seq is below its children's.
  const newest = new Map();
  for (const view of [...views].sort((a, b) => b.seq - a.seq)) {
    const own = Math.max(view.seq, newest.get(view.id) || 0);
    newest.set(view.id, own);
    if (view.parent_id && nodes.has(view.parent_id)) newest.set(view.parent_id, Math.max(newest.get(view.parent_id) || 0, own));
  }
  return { nodes, children, newest };
}

const parentOf = (tree, view) => (view.parent_id && tree.nodes.has(view.parent_id) ? view.parent_id : ROOT);

/** The messages from the root to `id`. */
export function pathTo(tree, id) {
  const path = [];
  for (let view = tree.nodes.get(id); view && path.length <= tree.nodes.size; view = tree.nodes.get(view.parent_id)) {
    path.push(view);
  }
  return path.reverse();
}

/** The branch through `id`: the root to it, then down the children written to last. */
export function branchThrough(tree, id) {
  const branch = pathTo(tree, id);
  for (let kids = tree.children.get(id); kids && kids.length; kids = tree.children.get(branch.at(-1).id)) {
    branch.push(kids.reduce((best, kid) => (tree.newest.get(kid.id) > tree.newest.get(best.id) ? kid : best)));
  }
  return branch;
}

/** `{index, count}` of a message among its siblings (index from 1), and the sibling `step` away. */
export function versionsOf(tree, id, step = 0) {
  const view = tree.nodes.get(id);
  if (!view) return { index: 1, count: 1, sibling: null };
  const siblings = tree.children.get(parentOf(tree, view)) || [view];
  const at = siblings.findIndex((s) => s.id === id);
  return { index: at + 1, count: siblings.length, sibling: siblings[at + step] || null };
}
