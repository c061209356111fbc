"""A jar that looks like Spark's Kafka connector to a classpath scan, without a class in it.

It holds what a real spark-sql-kafka-0-10 jar holds for finding it and reading its version (the
KafkaSourceProvider class file's name, Maven's pom.properties, the manifest), but no service
registration, so Spark never tries to load it as a data source.
"""

import zipfile
from pathlib import Path

CLASS_PATH = "org/apache/spark/sql/kafka010/KafkaSourceProvider.class"


def fake_connector(
    directory: Path,
    version: str,
    scala: str = "2.13",
    *,
    pom: bool = True,
    manifest: bool = True,
    name: str | None = None,
) -> Path:
    artifact = f"spark-sql-kafka-0-10_{scala}"
    path = directory / (name or f"{artifact}-{version}.jar")
    with zipfile.ZipFile(path, "w") as jar:
        if manifest:
            jar.writestr(
                "META-INF/MANIFEST.MF",
                f"Manifest-Version: 1.0\nImplementation-Title: Kafka 0.10+ Source for Structured Streaming\n"
                f"Implementation-Version: {version}\n",
            )
        if pom:
            jar.writestr(
                f"META-INF/maven/org.apache.spark/{artifact}/pom.properties",
                f"artifactId={artifact}\ngroupId=org.apache.spark\nversion={version}\n",
            )
        jar.writestr(CLASS_PATH, b"\xca\xfe\xba\xbe not a real class")
    return path
