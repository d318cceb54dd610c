"""bench.py's rows: the models it times (models.py: ours, BertForMaskedLM, LTG-BERT's own model
code in ltg_bert.py) and single operations (ops.py: attention forms, the EMA update)."""
