"""Make lordo_fed/corpora/python_docs.txt: English prose of the CPython documentation that every
Python install ships: the language reference's topics (`pydoc_data.topics`) and the docstrings of
stdlib modules that python_stdlib.txt does not contain (lordo_fed/corpora/README.md).

    python scripts/make_python_docs_corpus.py lordo_fed/corpora/python_docs.txt

The shipped file was made with CPython 3.11.7 (1,111,092 bytes, sha256 655aea407e9e25f4...); another
Python version gives other text, so the file is shipped rather than made at run time."""
import hashlib
import importlib
import inspect
import sys

import pydoc_data.topics as t

MODULES = ["abc", "ast", "asyncio", "base64", "binascii", "bisect", "builtins", "bz2", "cmd", "codecs",
           "collections", "contextlib", "copy", "csv", "datetime", "decimal", "email.message", "enum", "filecmp",
           "fnmatch", "ftplib", "getopt", "gettext", "glob", "gzip", "hashlib", "hmac", "html.parser",
           "http.client", "http.server", "imaplib", "io", "ipaddress", "itertools", "json", "locale", "logging",
           "lzma", "mailbox", "math", "mimetypes", "multiprocessing.pool", "operator", "optparse", "os",
           "pathlib", "pickle", "platform", "plistlib", "poplib", "re", "reprlib", "secrets", "selectors",
           "shelve", "signal", "smtplib", "socket", "socketserver", "sqlite3", "ssl", "stat", "struct",
           "subprocess", "sys", "tarfile", "time", "timeit", "trace", "traceback", "unittest.case", "urllib.parse",
           "urllib.request", "uuid", "warnings", "wave", "xml.dom.minidom", "xml.etree.ElementTree", "zlib"]
parts = [f"# ---- topic: {k} ----\n{t.topics[k].strip()}\n" for k in sorted(t.topics)]
for name in MODULES:
    mod = importlib.import_module(name)
    docs = []
    if inspect.getdoc(mod):
        docs.append(inspect.getdoc(mod))
    for attr, obj in sorted(vars(mod).items()):
        if attr.startswith("_") or getattr(obj, "__module__", None) != mod.__name__:
            continue
        if inspect.isclass(obj) or inspect.isroutine(obj):
            doc = inspect.getdoc(obj)
            if doc and len(doc) > 40:
                docs.append(f"{attr}: {doc}")
            if inspect.isclass(obj):
                for m, f in sorted(vars(obj).items()):
                    d = None if m.startswith("_") else inspect.getdoc(f)
                    if d and len(d) > 40 and d != doc:
                        docs.append(f"{attr}.{m}: {d}")
    parts.append(f"# ---- module: {name} ----\n" + "\n\n".join(docs) + "\n")
text = "\n".join(parts)
open(sys.argv[1], "w").write(text)
print(len(text.encode()), hashlib.sha256(text.encode()).hexdigest()[:16])
