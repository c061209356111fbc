"""The state topic: bucket snapshots in Kafka, so a partition changes owner without reading its log again.

* `image.py`: the records (keys, manifest) and a partition's index put back together from them;
* `mirror.py`: the bucket tracker's storage, which queues every seal, merge and delete for the topic;
* `topic.py`: the Kafka edge: the topic's creation, writes at the checkpoint, reads at a handoff.
"""
