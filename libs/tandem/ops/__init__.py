"""Tools for the people who run Tandem: `tandem plan` (capacity worksheets), `tandem bench serve`
(load against an OpenAI-compatible endpoint) and `tandem top` (a live view of the local stack)."""
