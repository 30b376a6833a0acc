"""execution/apps - the applications bundled with ZZ: kv, microbench, the WSGI adapter, guestbook.
They double as worked examples of the App interface (docs/apps.md); registry.py names them."""
