"""`streamload demo`: a small multi-source corpus, an embedded S3 server and two gloo ranks.

corpus.py  generates the corpus (long-tailed lengths, several formats) and its manifest
s3server.py  an in-process moto S3 server on 127.0.0.1, for the S3 sources
run.py     the demo job: upload, spawn the ranks, print steps, verify exactly-once, summarize
"""
